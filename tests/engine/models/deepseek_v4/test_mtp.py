"""The MTP layer (engine/models/deepseek_v4/mtp.py) against a reference built on transformers' own V4 block.

transformers does not instantiate `mtp.*`, so the reference is: transformers' main model for the
last residual streams (hooked before its HC head), the MTP preamble in plain torch (norms, e_proj,
h_proj, the zeroed embedding at position 0), then transformers' DeepseekV4DecoderLayer, HC head,
norm and LM head, loaded from the MTP tensors renamed as a one-layer checkpoint. Float64 on both
sides; tolerance as tests/engine/models/deepseek_v4/test_model.py: 1e-4 x max |logit|.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cache import KVCache
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.mtp import MTP
from engine.models.deepseek_v4.random_checkpoint import write_tokenizer
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.sequence import Sequence
from tests.engine.conftest import reference_model

TOL = 1e-4


def _mtp_as_model(src, dst):
    """The MTP block as layer 0 of a one-layer checkpoint transformers can load."""
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    out = {"embed.weight": w["embed.weight"], "head.weight": w["head.weight"], "norm.weight": w["mtp.0.norm.weight"]}
    for k in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
        out[k] = w[f"mtp.0.{k}"]
    skip = ("e_proj", "h_proj", "enorm", "hnorm", "norm.weight", "hc_head")
    out.update({"layers.0." + k[6:]: v for k, v in w.items() if k.startswith("mtp.0.") and not k[6:].startswith(skip)})
    cfg.update(num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
    if "layer_types" in cfg:
        cfg["layer_types"] = ["sliding_attention"]
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(dst)
    return w


def _reference_mtp_logits(src, tmp_path, ids):
    """MTP logits at every position i < len(ids) - 1 (input t_{i+1}), predicting t_{i+2}."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    main = reference_model(src, torch.float64)
    streams = {}
    main.model.hc_head.register_forward_pre_hook(lambda m, a: streams.setdefault("h", a[0]))
    w = _mtp_as_model(src, tmp_path / "mtp_as_model")
    block = reference_model(tmp_path / "mtp_as_model", torch.float64)
    w = {k: v.double() for k, v in w.items()}
    rms = lambda x, g: g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    with torch.no_grad():
        main(torch.tensor([ids]))
        h = streams["h"][0, :-1]  # [T-1, hc, D]: position i
        nxt = torch.tensor(ids[1:])
        e = w["embed.weight"][nxt]
        e[0] = 0  # position 0
        x = rms(h, w["mtp.0.hnorm.weight"]) @ w["mtp.0.h_proj.weight"].T
        x = x + (rms(e, w["mtp.0.enorm.weight"]) @ w["mtp.0.e_proj.weight"].T)[:, None]
        m = block.model
        pos = torch.arange(len(ids) - 1)[None]
        x = x[None]
        rope = {k: m.rotary_emb(x[:, :, 0], position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=m.config, inputs_embeds=x[:, :, 0], attention_mask=None,
                                                 cache=None, position_ids=pos)
        y = m.layers[0](x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=nxt[None])
        return block.lm_head(m.norm(m.hc_head(y)))[0]


@pytest.mark.parametrize("shape", ["tiny", "official-ratios"])
def test_mtp_logits_match_reference_over_chunks_and_the_window(checkpoints, shape, tmp_path):
    path = checkpoints[shape]
    model = load_model(path, torch.float64)
    cfg = model.cfg
    mtp = MTP.from_model(model)
    assert not model.mtp_weights  # moved, not copied
    n = 3 * cfg.sliding_window + 5  # MTP positions cross its window several times
    ids = torch.randint(5, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    want = _reference_mtp_logits(path, tmp_path, ids)

    # the engine: main model in a prefill chunk then single tokens; the MTP follows each step over
    # the rows whose next token is known (t_{i+1}), in its own paged window KV
    bs = max(16, cfg.compress_block_lcm)
    cache = KVCache(cfg, bs, 64, 64, 2, torch.float64)
    mcache = mtp.make_cache(cache)
    runner = ModelRunner(model, cache)
    seq = Sequence("t", list(ids), SamplingParams())
    got, W = [], cfg.sliding_window
    for size in [n - 9] + [1] * 8:
        s = seq.num_computed_tokens
        cache.allocate(seq.blocks, max(0, s - W + 1), s + size)
        fb = runner.build_batch([(seq, size)])
        h = model.hidden_states(fb, cache)
        fb.input_ids = torch.tensor(ids[s + 1:s + size + 1])
        fb.plans = {}
        got.append(mtp.compute_logits(model, mtp(model, fb, mcache, h)))
        seq.num_computed_tokens = seq.compress_from = s + size
        cache.release_window_below(seq.blocks, s + size - W + 1)
    got = torch.cat(got)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= TOL * want.abs().max()


def test_a_checkpoint_without_mtp_is_refused_clearly(tmp_path):
    from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
    from engine.models.weights import WeightsError

    path = write_checkpoint(tmp_path / "nomtp", "tiny", seed=1, override={"num_nextn_predict_layers": 0})
    with pytest.raises(WeightsError, match="MTP layer"):
        MTP.from_model(load_model(path, torch.float32))
