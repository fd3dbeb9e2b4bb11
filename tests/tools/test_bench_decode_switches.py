"""tools.bench_decode_switches: its configs name PDL, fusions and kernel variants; a CPU run on the tiny model goes
through every config, each row naming its variants."""

import json
import subprocess
import sys

import pytest

from kernels import variants
from tools.bench_decode_switches import parse_config


def test_configs_name_pdl_fusions_and_variants():
    assert parse_config("pdl") == ("pdl", True, (), variants.enabled())  # unnamed: the variants the process has
    assert parse_config("mega_gate") == ("mega_gate", True, ("mega_gate",), variants.enabled())  # on today's PDL step
    assert parse_config("frag=pdl:1+var:rope_tiles/moe_frag") == ("frag", True, (), ("rope_tiles", "moe_frag"))
    assert parse_config("plain=pdl:0+fuse:none+var:none") == ("plain", False, (), ())
    with pytest.raises(ValueError, match="unknown kernel variants"):
        parse_config("x=var:moe_fast")
    with pytest.raises(ValueError, match="parts are"):
        parse_config("x=graphs:1")


def test_a_cpu_run_reports_each_config_with_its_variants(tmp_path):
    out = tmp_path / "switches.json"
    subprocess.run([sys.executable, "-m", "tools.bench_decode_switches", "--model", "", "--batches", "1", "--steps", "2",
                    "--configs", "pdl,moe_frag=pdl:1+var:rope_tiles/moe_frag", "--engine-args", "{}", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["variants"]) for r in rows] == [("pdl", list(variants.enabled())),
                                                            ("moe_frag", ["rope_tiles", "moe_frag"])]
    assert all(r["logits_ok"] for r in rows)
