"""Families no earlier test used (tests/models/families/): HF Falcon (multi-query attention from
one fused projection, hand-written ``x @ weight.T`` linears, parallel attention and MLP),
GPT-BigCode (multi-query, fused c_attn), Electra (embeddings projected to the hidden width),
Phi-3 (fused qkv_proj and gate_up_proj), StableLM (partial rotary, qkv biases), Qwen2-MoE
(routed experts and a gated shared expert; no float64 CPU kernel, so float32), Whisper (conv1d
front end, frozen sinusoidal encoder positions, cross-attention), CLIP's text model (pooling at
one token per row), SegFormer (spatial-reduction attention, Mix-FFN with a depthwise conv), HF
Swin (shifted windows by torch.roll, relative position bias), timm BEiT (relative position
bias, layer scale), CaiT (talking heads, class attention), PoolFormer (pooling token mixer,
GroupNorm), EfficientNet (squeeze and excitation, BatchNorm), RegNetY (grouped 3x3 convs,
squeeze and excitation, BatchNorm) and Wav2Vec2 (a strided conv feature extractor over the
waveform, a grouped positional conv under weight norm).

What they showed (each with a fast test of its own): Whisper's frozen positions were trained
(tests/test_frozen_parameters.py); Falcon's ``weight.T`` was unannotated and its matmul had no
``out``/``in`` (tests/test_hand_linear.py); Phi-3's fused gate_up was split gate-from-up and
gathered (tests/test_fused_gate_up.py); CLIP's ``h[arange(B), eos]`` was a lookup of the whole
batch, gathered under dp and refused by micro-batches (tests/test_trace_aligned.py);
SegFormer's depthwise conv and RegNet's grouped convs could not follow a column-parallel
split (tests/test_depthwise_split.py). A head split of a fused multi-query or grouped-query
projection sliced into pieces of different sizes (Falcon, BigCode, Phi-3) is refused at the
plan's line (tests/plans/phase_bad): those families run their MLPs tensor-parallel
(mlp_tp.ssp).

Every run is ``--check --optimizer sgd`` in float64 unless said: the oracle is the plain model
trained on one device. Slow (processes, third-party models)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main

HERE = Path(__file__).resolve().parent / "models" / "families"
HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                        reason="transformers is not installed")
TIMM = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")


def _tp(blocks, attn, attn_out, mlp, mlp_out):
    return ["megatron_tp", "--set", f"blocks={blocks}", "--set", f"attn={attn}", "--set",
            f"attn_out={attn_out}", "--set", f"mlp={mlp}", "--set", f"mlp_out={mlp_out}"]


def _mlp_tp(blocks, mlp, mlp_out):
    return [str(HERE / "mlp_tp.ssp"), "--set", f"blocks={blocks}", "--set", f"mlp={mlp}",
            "--set", f"mlp_out={mlp_out}"]


ONE_F_ONE_B = ["1f1b", "--set", "microbatches=4"]
GPIPE = ["gpipe", "--set", "microbatches=4"]
F64, F32 = "float64", "float32"
FALCON_MLP = _mlp_tp("lm.transformer.h.*", "mlp", "mlp.dense_4h_to_h")
BIGCODE_MLP = _mlp_tp("lm.transformer.h.*", "mlp", "mlp.c_proj")
PHI3_MLP = _mlp_tp("lm.model.layers.*", "mlp", "mlp.down_proj")
WHISPER_TP = [str(HERE / "whisper_tp.ssp")]
SEGFORMER_MLP = _mlp_tp("seg.segformer.stages.*.blocks.*", "mlp", "mlp.fc2")
# (family, plan and its arguments, dtype)
CASES = [
    ("hf_falcon", ["dp"], F64), ("hf_falcon", ONE_F_ONE_B, F64), ("hf_falcon", FALCON_MLP, F64),
    ("hf_falcon", GPIPE, F64),
    ("hf_bigcode", ONE_F_ONE_B, F64), ("hf_bigcode", BIGCODE_MLP, F64),
    ("hf_bigcode", ["dp_zero"], F64),
    ("hf_electra", _tp("lm.electra.encoder.layer.*", "attention", "attention.output.dense",
                       "intermediate", "output.dense"), F64),
    ("hf_electra", ONE_F_ONE_B, F64), ("hf_electra", GPIPE, F64),
    ("hf_phi3", PHI3_MLP, F64), ("hf_phi3", ONE_F_ONE_B, F64), ("hf_phi3", ["dp_zero"], F64),
    ("hf_stablelm", _tp("lm.model.layers.*", "self_attn", "self_attn.o_proj", "mlp",
                        "mlp.down_proj"), F64),
    ("hf_stablelm", ONE_F_ONE_B, F64),
    ("hf_qwen2moe", ["dp"], F32),
    ("hf_qwen2moe", _tp("lm.model.layers.*", "self_attn", "self_attn.o_proj",
                        "mlp.shared_expert", "mlp.shared_expert.down_proj"), F32),
    ("hf_whisper", ["dp"], F64), ("hf_whisper", WHISPER_TP, F64),
    ("hf_whisper", ONE_F_ONE_B, F64), ("hf_whisper", ["dp_zero"], F64),
    ("hf_clip_text", ["dp"], F64), ("hf_clip_text", ONE_F_ONE_B, F64),
    ("hf_clip_text", _tp("text.text_model.encoder.layers.*", "self_attn", "self_attn.out_proj",
                         "mlp", "mlp.fc2"), F64),
    ("timm_beit", _tp("blocks.*", "attn", "attn.proj", "mlp", "mlp.fc2"), F64),
    ("timm_beit", ONE_F_ONE_B, F64),
    ("timm_cait", _tp("blocks.*", "attn", "attn.proj", "mlp", "mlp.fc2"), F64),
    ("timm_cait", ONE_F_ONE_B, F64),
    ("timm_poolformer", ["dp"], F64), ("timm_poolformer", ONE_F_ONE_B, F64),
    ("timm_poolformer", GPIPE, F64),
    ("hf_segformer", ["dp"], F64), ("hf_segformer", ONE_F_ONE_B, F64),
    # stage 0 has one head: megatron_tp on stage 1, the MLPs of both (depthwise convs inside)
    ("hf_segformer", _tp("seg.segformer.stages.1.blocks.*", "attention", "attention.o_proj",
                         "mlp", "mlp.fc2"), F64),
    ("hf_segformer", SEGFORMER_MLP, F64),
    ("timm_regnet", [str(HERE / "regnet_tp.ssp")], F64),
    ("hf_wav2vec2", ["dp"], F64), ("hf_wav2vec2", ONE_F_ONE_B, F64),
    ("hf_wav2vec2", _tp("w2v.wav2vec2.encoder.layers.*", "attention", "attention.out_proj",
                        "feed_forward", "feed_forward.output_dense"), F64),
    ("hf_wav2vec2", [str(HERE / "wav2vec2_pos_conv.ssp")], F64),
    ("hf_swin", ["dp"], F64), ("hf_swin", ONE_F_ONE_B, F64),
    ("hf_swin", _tp("swin.swin.encoder.layers.*.blocks.*", "attention", "attention.o_proj",
                    "mlp", "mlp.fc2"), F64),
]


def _id(case) -> str:
    family, plan, _ = case
    name = plan[0].rsplit("/", 1)[-1].removesuffix(".ssp")
    return f"{family}-{name}"


def _run(capsys, model: Path, plan: list[str], dtype: str, *extra: str):
    code = main(["run", str(model), plan[0], "--nproc", "2", *plan[1:], "--check", "--dtype",
                 dtype, "--optimizer", "sgd", "--steps", "2", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize("family, plan, dtype", [
    pytest.param(*c, marks=TIMM if c[0].startswith("timm") else HF, id=_id(c)) for c in CASES])
def test_family_matches_the_plain_model(capsys, family, plan, dtype):
    code, out = _run(capsys, HERE / f"{family}.py", plan, dtype)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    bound = 1e-9 if dtype == F64 else 1e-4
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < bound and worst["param"] < bound


# forward all-reduces (row-parallel products) and backward ones (column-parallel groups; the
# encoder output read by both decoder layers' cross-attention keys and values adds one)
MINIMUM = [
    pytest.param("hf_phi3", PHI3_MLP, 2, 2, marks=HF, id="hf_phi3-mlp_tp"),
    pytest.param("hf_falcon", FALCON_MLP, 2, 2, marks=HF, id="hf_falcon-mlp_tp"),
    pytest.param("hf_whisper", WHISPER_TP, 2 * 2 + 2 * 3, 2 * 2 + 2 * 3 + 1, marks=HF,
                 id="hf_whisper-whisper_tp"),
    pytest.param("hf_segformer", SEGFORMER_MLP, 2, 2, marks=HF, id="hf_segformer-mlp_tp"),
    # per bottleneck: forward after se.fc1 and conv3, backward before conv1 and se.fc2
    pytest.param("timm_regnet", [str(HERE / "regnet_tp.ssp")], 4 * 2, 4 * 2, marks=TIMM,
                 id="timm_regnet-regnet_tp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, plan, forward, backward", MINIMUM)
def test_tensor_parallel_is_the_megatron_minimum(capsys, family, plan, forward, backward):
    code = main(["check", str(HERE / f"{family}.py"), plan[0], "--world", "2", *plan[1:],
                 "--json"])
    comm = json.loads(capsys.readouterr().out)["communication"]
    assert code == 0
    assert {k: v["count"] for k, v in comm["forward"].items() if k != "chunk"} == \
        {"all_reduce": forward}
    assert {k: v["count"] for k, v in comm["backward"].items() if k != "chunk"} == \
        {"all_reduce": backward}
    assert comm["gradients"] == {}


@pytest.mark.slow
@TIMM
@pytest.mark.parametrize("plan, line", [(["dp"], "dp.ssp:7:1"), (ONE_F_ONE_B, "1f1b.ssp:10:1"),
                                        (["dp_zero"], "dp_zero.ssp")])
def test_efficientnet_batch_norm_is_refused_where_the_batch_is_split(capsys, plan, line):
    code = main(["check", str(HERE / "timm_efficientnet.py"), plan[0], "--world", "2",
                 *plan[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert line in err and "batch normalization" in err and "\nhint: " in err
    if plan == ["dp"]:
        # named by the plan's word; the hint gives the statements that keep data parallelism,
        # exact (``BN_PLANS["dp"]``, which test_batch_norm_keeps_its_running_statistics trains)
        assert "dimension 'batch' ('d0') of operator 'batch_norm'" in err
        assert ("`partition all except kind(batch_norm) along batch into 2`, then "
                "`replicate kind(batch_norm) into 2`") in err


BN_PLANS = {
    "channels": "partition kind(batch_norm) along d1 into n\nreplicate rest into n\n",
    "dp": "partition all except kind(batch_norm) along batch into n\n"
          "replicate kind(batch_norm) into n\n",
}


@pytest.mark.slow
@TIMM
@pytest.mark.parametrize("family, layout", [("timm_efficientnet", "channels"),
                                            ("timm_efficientnet", "dp"),
                                            ("timm_regnet", "dp"), ("timm_regnet", "regnet_tp")])
def test_batch_norm_keeps_its_running_statistics(capsys, tmp_path, family, layout):
    """BatchNorm split by channels (alone, or inside RegNet's channel-parallel bottlenecks with
    their grouped convs), or replicated under data parallelism (it gathers the batch, as a
    synchronized batch norm does), with squeeze-and-excitation gates after it: the training
    and the running statistics of the saved state equal the plain model's."""
    from ssdsl.runtime.reference import OptimizerSpec, run_reference
    from ssdsl.trace.model_file import load_model_file

    plan = tmp_path / "bn.ssp"
    if layout in BN_PLANS:
        plan.write_text(f"plan bn(n: int = world)\n{BN_PLANS[layout]}"
                        "assign each part i to device i\n")
    else:
        plan = HERE / f"{layout}.ssp"
    saved = tmp_path / "state.pt"
    model = HERE / f"{family}.py"
    code, out = _run(capsys, model, [str(plan)], F64, "--save", str(saved))
    assert out["check"]["ok"] and code == 0
    ref = run_reference(load_model_file(str(model)), steps=2, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd"))
    state = torch.load(saved)
    stats = [k for k in ref.final_state if k.endswith(("running_mean", "running_var"))]
    assert len(stats) >= 10
    for k in stats:
        assert torch.allclose(state[k].to(ref.final_state[k].dtype), ref.final_state[k],
                              rtol=1e-12, atol=1e-14), k


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=TIMM if f.startswith("timm") else HF, id=f)
    for f in ["hf_falcon", "hf_bigcode", "hf_electra", "hf_phi3", "hf_stablelm", "hf_whisper",
              "hf_clip_text", "hf_segformer", "timm_beit", "timm_cait", "timm_poolformer",
              "timm_efficientnet", "timm_regnet", "hf_wav2vec2", "hf_swin"]])
def test_every_operator_is_annotated(family: str) -> None:
    """Falcon's ``weight.T`` (``aten.numpy_T``) and Wav2Vec2's ``_weight_norm`` were not;
    Qwen2-MoE's routing still is not (its ``topk`` and ``sort`` are; ``histc``, ``index_put_``,
    ``empty_like`` and transformers' grouped matmul are not), as Mixtral's."""
    from ssdsl.ops import NotAnnotated, annotate
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(HERE / f"{family}.py"), device="meta")
    missing = [(op.name, op.target, a.reason) for op in graph.ops
               if isinstance(a := annotate(graph, op), NotAnnotated)]
    assert not missing


@pytest.mark.slow
@HF
def test_whisper_positions_stay_frozen(capsys, tmp_path):
    """Whisper's sinusoidal encoder positions (``requires_grad=False``) come out of dp
    training as they went in, and as the plain model leaves them."""
    from ssdsl.trace.model_file import load_model_file

    saved = tmp_path / "state.pt"
    model = HERE / "hf_whisper.py"
    code, out = _run(capsys, model, ["dp"], F64, "--save", str(saved))
    assert out["check"]["ok"] and code == 0
    key = "lm.model.encoder.embed_positions.weight"
    first = load_model_file(model).build(seed=0).state_dict()[key]
    assert torch.equal(torch.load(saved)[key].to(first.dtype), first)


@pytest.mark.slow
@HF
def test_micro_batches_over_moe_routing_are_refused_with_the_cause(capsys):
    """Qwen2-MoE's experts read their tokens by indices computed at run time; micro-batches
    are refused at the plan's microbatch line, with a hint that names the routing (not the
    batch-norm advice the batch statistics get)."""
    code = main(["check", str(HERE / "hf_qwen2moe.py"), *ONE_F_ONE_B, "--world", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "1f1b.ssp:10:1" in err and "looked up by index" in err
    assert "mixture of experts" in err and "BatchNorm" not in err
