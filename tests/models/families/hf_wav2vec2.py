"""HF Wav2Vec2ForSequenceClassification, tiny config: a strided conv1d feature extractor over
the raw waveform (GroupNorm with one group per channel after the first conv), a feature
projection, a grouped positional conv under weight norm, post-norm encoder layers, mean
pooling and a classifier."""
import torch, torch.nn as nn
HIDDEN, LAYERS, HEADS, SAMPLES, CLASSES = 32, 2, 4, 400, 5
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "samples"),)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification
        c = Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                           conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                           num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                           feat_extract_norm="group", do_stable_layer_norm=False,
                           hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                           mask_time_prob=0.0, mask_feature_prob=0.0, num_labels=CLASSES,
                           classifier_proj_size=16, use_weighted_layer_sum=False)
        c._attn_implementation = "sdpa"
        self.w2v = Wav2Vec2ForSequenceClassification(c)
    def forward(self, x):
        return self.w2v(input_values=x).logits

def build_model():
    return Classifier()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3500 + step)
    return torch.randn(batch_size, SAMPLES, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
