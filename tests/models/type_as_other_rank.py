"""A mask cast ``type_as`` a tensor of another rank (HF Funnel's
``attention_mask.type_as(inputs_embeds)``): the (batch, seq, c) embeddings are read for their
dtype only, while the cast's own batch comes from the (batch, seq) mask."""
import torch, torch.nn as nn
VOCAB, WIDTH, SEQ = 32, 16, 8
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        keep = (idx > 3).type_as(x)            # x's batch read for its dtype only
        ones = x.new_ones(idx.shape)           # the same through new_ones of another rank
        h = torch.tanh(self.fc(x)) * (keep * ones).unsqueeze(-1)
        return self.head(h)


def build_model():
    return Masked()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(300 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
