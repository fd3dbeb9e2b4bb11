"""tools.bench_decode_switches: its configs name PDL, fusions and kernel variants; a CPU run on the tiny model goes
through every config, each row naming its variants."""

import json
import subprocess
import sys

import pytest

from kernels import fusions, variants
from tools.bench_decode_switches import parse_config, parse_configs


def test_configs_name_pdl_fusions_and_variants():
    assert parse_config("pdl") == ("pdl", True, (), variants.enabled())  # unnamed: the variants the process has
    assert parse_config("mega_gate") == ("mega_gate", True, ("mega_gate",), variants.enabled())  # on today's PDL step
    assert parse_config("frag=pdl:1+var:rope_tiles/moe_frag") == ("frag", True, (), ("rope_tiles", "moe_frag"))
    assert parse_config("plain=pdl:0+fuse:none+var:none") == ("plain", False, (), ())
    with pytest.raises(ValueError, match="unknown kernel variants"):
        parse_config("x=var:moe_fast")
    with pytest.raises(ValueError, match="parts are"):
        parse_config("x=graphs:1")
    assert [c[0] for c in parse_configs("pdl,each")] == ["pdl", *fusions.ALL]  # each: every fusion alone


def test_a_cpu_run_reports_each_config_with_its_variants(tmp_path):
    out = tmp_path / "switches.json"
    subprocess.run([sys.executable, "-m", "tools.bench_decode_switches", "--model", "", "--batches", "1", "--steps", "2",
                    "--configs", "pdl,moe_frag=pdl:1+var:rope_tiles/moe_frag", "--engine-args", "{}", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["variants"]) for r in rows] == [("pdl", list(variants.enabled())),
                                                            ("moe_frag", ["rope_tiles", "moe_frag"])]
    assert all(r["logits_ok"] for r in rows)


def test_a_cpu_run_on_a_rank_share_times_the_share(tmp_path):
    """--tp-share: rank 0's share built in memory (half the experts of the tiny model here) runs every config; the
    JSON names the share."""
    out = tmp_path / "share.json"
    subprocess.run([sys.executable, "-m", "tools.bench_decode_switches", "--tp-share", "2", "--experts", "8",
                    "--preset", "tiny", "--batches", "1", "--steps", "2", "--configs", "pdl,all", "--input-len", "32",
                    "--engine-args", '{"max_model_len":256,"max_num_seqs":8}', "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert got["meta"]["tp_share"] == {"world": 2, "experts": 8, "preset": "tiny"}
    assert [r["config"] for r in got["rows"]] == ["pdl", "all"] and all(r["logits_ok"] for r in got["rows"])


def test_a_checkpoint_or_a_share_one_of_them():
    done = subprocess.run([sys.executable, "-m", "tools.bench_decode_switches", "--batches", "1"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--model or --tp-share" in done.stderr
