"""Every benchmark suite, by the question it answers. `python -m benchmarks list` prints them."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.suite import Step, Suite

# Engine arguments shared by several suites
DEPTH = '{"max_model_len":8192,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
DEPTH_8K = DEPTH.replace('"max_model_len":8192', '"max_model_len":8320')  # an 8,192-token prompt and its outputs
SHAPED = '{"max_model_len":8192,"max_num_seqs":256,"block_size":128,"gpu_memory_utilization":0.6}'
V41 = '{"max_model_len":4096,"max_num_seqs":32,"block_size":128,"gpu_memory_utilization":0.9}'
V41_SERVE = '{"max_model_len":4096,"max_num_seqs":160,"block_size":128,"gpu_memory_utilization":0.9}'
SPEC = '{"max_model_len":4096,"block_size":128,"gpu_memory_utilization":0.9,"cudagraph_mode":"FULL_DECODE_ONLY"}'
MIXED = '{"max_model_len":8192,"block_size":128,"gpu_memory_utilization":0.9}'
MODEL = ("--preset", "{preset}", "--quant", "fp8-fp4", "--cache-dir", "{ckpt}")  # a random checkpoint as shipped
V41_CKPT = "{ckpt}/v41-flash-shaped-fp8-fp4"
DEPTH_CKPT = "{ckpt}/flash-depth-fp8-fp4"
SWITCH_CKPT = "{{ckpt}}/flash-depth-e{e}-fp8-fp4"  # one per expert count, removed after its step
SWITCHES = DEPTH[:-1] + ',"cudagraph_mode":"FULL_DECODE_ONLY"}'  # decode graphs only: no mixed-step captures to wait for
# on the rank share: today's step, every fusion, today's without moe_gemv, then each fusion alone
# (tools.bench_decode_switches)
TP_SHARE_SWITCH_CONFIGS = "pdl,all,no_moe_gemv=pdl:1+var:rope_tiles/bf16_gemv/attn_offsets,each"
# today's decode, then each decode variant that is off by default, then today's without each that is on (attn_offsets
# runs on the wgmma tiles, which batches from 16 take), then
# today's step last again (pdl_again): at batch 150 the last config ran fastest in three runs (1.10x, 1.14x, 1.06x), so
# a gap under the drift between the first and the last row is not the variant's
_TODAY = "rope_tiles/bf16_gemv/attn_offsets/moe_gemv"
DECODE_VARIANT_CONFIGS = ("pdl,no_moe_gemv=pdl:1+var:rope_tiles/bf16_gemv/attn_offsets,"
                          f"wo_a_one_launch=pdl:1+var:{_TODAY}/wo_a_one_launch,"
                          "no_bf16_gemv=pdl:1+var:rope_tiles/attn_offsets/moe_gemv,"
                          "no_attn_offsets=pdl:1+var:rope_tiles/bf16_gemv/moe_gemv,"
                          f"fp8_cublas_mid=pdl:1+var:{_TODAY}/fp8_cublas_mid,pdl_again=pdl:1+var:{_TODAY}")
# today's prefill (its default variants), then without attn_offsets, then with indexer_select (off)
PREFILL_VARIANT_SETS = "rope_tiles+bf16_gemv+attn_offsets,rope_tiles+bf16_gemv,rope_tiles+bf16_gemv+attn_offsets+indexer_select"
# a server configured for 128K-token contexts: its decode graphs' indexer rows are 32,768 entries wide
SWITCHES_128K = SWITCHES.replace('"max_model_len":8192', '"max_model_len":131072')
DSPARK_CKPT = "{ckpt}/flash-depth-0731-fp8-fp4"  # V4-Flash depth with 0731's DSpark stages (16 experts)
DSPARK_E64_CKPT = "{ckpt}/flash-depth-0731-e64-fp8-fp4"  # the same at 64 routed experts
SHAPED_CKPT = "{ckpt}/flash-shaped-fp8-fp4"  # V4-Flash's layers, 4 of them, as shipped (FP8 + MXFP4)
SHAPED_0731_CKPT = "{ckpt}/flash-shaped-0731-fp8-fp4"  # the same with 0731's DSpark stages
TRITON_SWEEP = ("--serve", "--driver", "threads", "--protocol", "grpc", "--stop-timeout", "20", "--out", "{out}")


def checkpoint(path: str, preset: str, *extra: str, name: str = "checkpoint") -> Step:
    """Draw a random checkpoint on the GPU unless it is there already (name: the step's, where a suite draws two)."""
    return Step("tools.make_tiny_checkpoint", (path, "--preset", preset, "--quant", "fp8-fp4", "--device", "cuda",
                                               *extra),
                name=name, json_flag=None, unless_exists=f"{path}/config.json", timeout_s=300)


def sweep(label: str, model: str, engine_args: str, *extra: str, timeout_s: int = 400) -> Step:
    """A closed-loop load test through the real Triton server (the engine core in its own process)."""
    return Step("loadtest.sweep", ("--model", model, "--engine-args", engine_args, *TRITON_SWEEP, "--label", label,
                                   *extra),
                name=label, json_flag=None, result=f"{{out}}/{label}.json", python="triton", timeout_s=timeout_s)


@dataclass(frozen=True)
class Serving:
    """One workload for the serving_vs_engine suites: the checkpoint, its engine arguments, the levels."""

    levels: str
    input_len: str
    output_len: str
    engine_args: str
    model: str | None  # None: the tiny model, on the CPU
    make_model: Step | None  # draws the checkpoint on a fresh machine
    where: str  # the checkpoint, in the question's words
    duration: str = "30"  # seconds of each level's closed-loop load (both legs), the warm-up included
    warmup: str = "0"  # its first seconds, left out of the rates and latencies (loadtest.window)
    stop_timeout: str = "20"  # seconds a level's in-flight requests get after it; the rest are cancelled
    timeout_s: int = 300  # each engine-direct run and each sweep


def serving_vs_engine(name: str, w: Serving, machine: str, legs: tuple[str, ...] = ("engine", "openai"),
                      notes: str = "") -> Suite:
    """Through Triton against the same engine called directly ("engine" in legs) and against the OpenAI front
    ("openai"), one workload, level by level; each sweep checks that its clients were not the limit
    (loadtest.saturation). Every leg runs the same closed-loop window (duration, warm-up, stop timeout) and
    counts it one way (loadtest.window), so a ratio compares like with like. Engine-direct and Triton run
    first, so a call cut short still answers the main question; the OpenAI leg sweeps Triton on its own
    machine too, so its ratio compares runs side by side."""
    shape = ("--concurrency", w.levels, "--input-len", w.input_len, "--output-len", w.output_len)
    window = ("--duration", w.duration, "--warmup", w.warmup, "--stop-timeout", w.stop_timeout)
    served = (("--model", w.model) if w.model else ()) + ("--engine-args", w.engine_args)
    sweep_ = ("--serve", *served, *shape, *window, "--driver", "threads", "--out", "{out}")
    engine = "engine" in legs
    steps = [] if w.make_model is None else [w.make_model]
    if engine:
        steps.append(Step("tools.bench_engine", (*(("--model", w.model) if w.model else ("--preset", "tiny")),
                                                 "--core-process", *shape, *window,
                                                 "--engine-args", w.engine_args, "--json", "{out}/engine_direct.json"),
                          name="engine_direct", json_flag=None, result="{out}/engine_direct.json",
                          timeout_s=w.timeout_s))
    steps.append(Step("loadtest.sweep", (*sweep_, "--protocol", "grpc", "--label", "triton"), name="triton",
                      json_flag=None, result="{out}/triton.json", python="triton", timeout_s=w.timeout_s))
    direct = ("{out}/engine_direct.json",) if engine else ()
    if engine:
        steps.append(Step("loadtest.vs_engine", ("{out}/triton.json", *direct), name="ratio", timeout_s=60))
    if "openai" in legs:
        steps += [Step("loadtest.sweep", (*sweep_, "--protocol", "openai", "--label", "openai"), name="openai",
                       json_flag=None, result="{out}/openai.json", python="triton", timeout_s=w.timeout_s),
                  Step("loadtest.vs_engine", ("{out}/triton.json", *direct, "--openai", "{out}/openai.json"),
                       name="ratio_openai", timeout_s=60)]
    workload = f"{w.where}, {w.levels.replace(',', ' / ')} users, {w.input_len} in / {w.output_len} out"
    if not engine:
        question = f"What does the OpenAI front (FastAPI + gRPC to Triton) cost against Triton direct ({workload})?"
    else:
        question = (f"Through Triton{', and through the OpenAI front,' if 'openai' in legs else ','} how close is "
                    f"serving to the same engine called directly ({workload}), with load generators that are not "
                    "the limit?")
    return Suite(name, question, tuple(steps), machine=machine, notes=notes)


# At 10 s levels counted from a cold start the ramp moved the ratio by up to 0.27x between runs (docs/PERF.md):
# a 5 s warm-up leaves the first prefills out (512 in at 256 users: ~3 s), and 20 s levels keep the suite
# at ~6 minutes now that engine-direct runs the same window
SHAPED_SERVING = Serving("1,32,150,256", "512", "64", SHAPED, "{ckpt}/flash-shaped",
                         Step("tools.make_tiny_checkpoint", ("{ckpt}/flash-shaped", "--preset", "flash-shaped",
                                                             "--device", "cuda"),
                              name="checkpoint", json_flag=None, unless_exists="{ckpt}/flash-shaped/config.json"),
                         "flash-shaped", duration="20", warmup="5")
# A request lasts ~16 s at 150 users (1024-token prompts; the first 150 prefills are a ~10 s burst): 15 s of
# warm-up, 30 s counted, and in-flight requests cancelled at the stop (draining them would cost ~16 s a level
# and leg); latencies then cover the requests sent in the window that finished in it, on both legs alike
DEPTH_SERVING = Serving("64,150", "1024", "128", DEPTH, DEPTH_CKPT, checkpoint(DEPTH_CKPT, "flash-depth"),
                        "V4-Flash depth as shipped", duration="45", warmup="15", stop_timeout="0", timeout_s=330)


# ---- the headline serving table (issue 40): V4-Flash depth as shipped through Triton, a curve per workload
# DEPTH with room for an 8K prompt and its 1K reply and 256 users in one batch; prefix caching on, as model.json ships
CURVE = ('{"max_model_len":10240,"max_num_seqs":256,"block_size":128,"gpu_memory_utilization":0.9,'
         '"enable_prefix_caching":true}')
# a fresh machine before the first level: the checkpoint draw (~30 s at 16 experts), the Triton venv
# (tools/h200_env.sh, ~15 s), the server's start with a cold Triton JIT cache (~180 s; ~55 s warm)
FRESH_START_S = 225
LEVEL_OVERHEAD_S = 8  # per level: the client processes' start (the tokenizer's word list), the metrics' settle
CALL_BUDGET_S = 540  # a 600 s device call less a margin for what the estimate leaves out


@dataclass(frozen=True)
class Curve:
    """One suite's share of the headline serving table: one workload at some levels through one server.
    Each level runs duration_s (its warm-up included), then in-flight requests get stop_timeout_s before
    they are cancelled (their tokens inside the window still count)."""

    name: str  # the suite's; its sweep's label with '-' for '_'
    levels: str
    workload: tuple[str, ...]  # loadtest.sweep's workload flags
    duration_s: int
    warmup_s: int
    stop_timeout_s: int
    sizing: str  # the request time the window is sized from, for the notes

    @property
    def label(self) -> str:
        return self.name.replace("_", "-")

    def estimate_s(self) -> int:
        """The suite's worst case on a fresh machine: every level's whole window and stop timeout."""
        return FRESH_START_S + len(self.levels.split(",")) * (self.duration_s + self.stop_timeout_s + LEVEL_OVERHEAD_S)


def depth_curve(c: Curve, question: str, whole: tuple[Curve, ...] = ()) -> Suite:
    """The curve's sweep through the real Triton server (client processes sized per level), then its headline
    table (loadtest.headline: per level, and read at 20 and 50 tok/s per user). whole: the suites one workload's
    curve is split over, whose sweeps loadtest.headline reads together."""
    # every level leaves out its first warmup_s seconds (loadtest.window; its duration holds them)
    levels = sweep(c.label, DEPTH_CKPT, CURVE, "--concurrency", c.levels, *c.workload, "--duration", str(c.duration_s),
                   "--stop-timeout", str(c.stop_timeout_s), "--warmup", str(c.warmup_s), timeout_s=c.estimate_s())
    table = Step("loadtest.headline", (f"{{out}}/{c.label}.json", "--at", "20,50"), name="table", timeout_s=60)
    counted = f"{c.duration_s - c.warmup_s} s counted after {c.warmup_s} s of warm-up"
    curve = (f"; the whole curve: python -m loadtest.headline {' '.join(f'{x.label}.json' for x in whole)}"
             if whole else "")
    notes = (f"about {c.estimate_s() / 60:.1f} minutes at worst on a fresh machine (checkpoint, Triton venv and a cold "
             f"server start ~{FRESH_START_S} s, then each level {c.duration_s} s, up to {c.stop_timeout_s} s for "
             f"in-flight requests and ~{LEVEL_OVERHEAD_S} s); {c.sizing}: {counted}{curve}")
    return Suite(c.name, question, (checkpoint(DEPTH_CKPT, "flash-depth"), levels, table), notes=notes)


ONE_K = ("--input-len", "1024", "--output-len", "128")
EIGHT_K = ("--input-len", "8192", "--output-len", "1024")
# long shared context, then turns as an agent's: each request re-sends the conversation (prefix-cache hits)
AGENTIC = ("--workload", "agentic", "--system-len", "4096", "--turn-len", "128:384", "--output-len", "128:384",
           "--turns", "6")
# 8 and 16 users beside the 1 / 32 / 64: 50 tok/s per user lies between 1 user and 32 at this depth
# (interactivity_depth: 82 tok/s per user at 1 user, 21 at 32)
CURVE_1K = Curve("depth_curve_1k", "1,8,16,32,64", ONE_K, 40, 10, 8,
                 "a request lasts ~2 s at 1 user to ~9 s at 64 (H100, serving_vs_engine_depth)")
CURVE_1K_HIGH = Curve("depth_curve_1k_high", "150,256", ONE_K, 110, 45, 15,
                      "a request lasts ~16 s at 150 users, ~30 s at 256, whose first prefills alone (262k tokens at "
                      "~8k tok/s) take ~30 s")
CURVE_8K = Curve("depth_curve_8k", "1,8", EIGHT_K, 90, 25, 20,
                 "1024 decode steps of ~12-16 ms: a request lasts ~14 s at 1 user, ~20 s at 8")
CURVE_8K_32 = Curve("depth_curve_8k_32", "32", EIGHT_K, 240, 80, 20,
                    "32 prompts of 8K are ~260k prefill tokens (~35 s) and a request lasts ~50 s")
CURVE_8K_64 = Curve("depth_curve_8k_64", "64", EIGHT_K, 280, 100, 20,
                    "64 prompts of 8K are ~520k prefill tokens (~65 s) and a request lasts ~60-90 s")
CURVE_AGENTIC = Curve("depth_curve_agentic", "8,32,64", AGENTIC, 70, 15, 10,
                      "a turn (~256 output tokens) lasts ~4 s at 8 users, ~9 s at 64; after the first request only "
                      "the newest turn is prefilled")
CURVES_1K, CURVES_8K = (CURVE_1K, CURVE_1K_HIGH), (CURVE_8K, CURVE_8K_32, CURVE_8K_64)


def expert_checkpoint(experts: int, name: str = "checkpoint") -> Step:
    """V4-Flash depth as shipped at this routed-expert count (SWITCH_CKPT)."""
    return checkpoint(SWITCH_CKPT.format(e=experts), "flash-depth", "--override",
                      f'{{"n_routed_experts":{experts}}}', name=name)


def decode_ab_steps(configs: str, experts: int) -> tuple[Step, ...]:
    """A depth checkpoint at this routed-expert count, then today's decode step against a variant's (configs) in one
    engine, logits compared."""
    ckpt = SWITCH_CKPT.format(e=experts)
    return (expert_checkpoint(experts),
            decode_ab(ckpt, configs, SWITCHES, f"e{experts}", then_remove=f"flash-depth-e{experts}-*"))


def decode_ab(ckpt: str, configs: str, engine_args: str, label: str, *extra: str, then_remove: str | None = None
              ) -> Step:
    """tools.bench_decode_switches: today's decode step against the configs' in one engine, logits compared."""
    return Step("tools.bench_decode_switches", ("--model", ckpt, "--configs", configs, "--single-batches", "all",
                                                "--engine-args", engine_args, "--label", label, *extra),
                name=label, then_remove=then_remove,
                timeout_s=max(420, 180 + 90 * len(configs.split(","))))  # an engine start, then ~1.5 min a config


def closed_loop(budgets: str, policies: str, users: str, timeout_s: int) -> Step:
    """tools.bench_mixed's chunk-budget rows at V4-Flash depth: 1024 in / 128 out, 2 requests a user, the engine's
    own step loop, no graph check or step timing."""
    return Step("tools.bench_mixed", ("--model", DEPTH_CKPT, "--budgets", budgets, "--policies", policies, "--users",
                                      users, "--requests-per-user", "2", "--input-len", "1024", "--output-len", "128",
                                      "--check-budget", "0", "--step-budgets", "", "--engine-args", MIXED),
                timeout_s=timeout_s)


# the decode profiles' rows: (step name, batch, extra arguments); under PDL a kernel's time includes its wait
PROFILE_ROWS = (("batch1", "1", ()), ("batch1_pdl_off", "1", ("--engine-args", '{"pdl":"off"}')),
                ("batch150", "150", ()), ("batch150_pdl_off", "150", ("--engine-args", '{"pdl":"off"}')))


def profile(name: str, *args: str, then_remove: str | None = None) -> Step:
    """tools.profile_decode: kernels by CUDA time (a text table, kept as the step's output)."""
    return Step("tools.profile_decode", args, name=name, json_flag=None, then_remove=then_remove, timeout_s=200)


SUITE_LIST = [
    # ---- correctness first: run these before any timing suite
    Suite("teacher_forced", "Fed the same tokens (8 prompts x 256 positions, one decode step each), does "
          "the engine at V4-Flash depth as shipped (16 MXFP4 experts, FP8 linears, fused kernels, CUDA graphs) "
          "predict what the torch references predict (float32, and rounding where the kernels store; top-1 >= 99%, "
          "mean KL <= 1e-3), and where they part, which layer moves first? Beside it the noise floor: how far "
          "correct references part on the same tokens (float32 vs rounded; rounded vs itself summing in another "
          "order), and is the engine within 2x of the latter?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.check_teacher_forced", ("--model", DEPTH_CKPT, "--reference", "float32"), name="v4_depth",
                timeout_s=500),
           # the rounded references decode eagerly in the engine's schedule (one reference forward per step); the
           # floor adds a float32 prefill per prompt, the reordered reference's run and one probe per pair
           Step("tools.check_teacher_forced", ("--model", DEPTH_CKPT, "--reference", "rounded", "--steps", "64",
                                               "--floor"), name="v4_depth_rounded", timeout_s=600))),
    Suite("teacher_forced_switches", "At V4-Flash depth as shipped, is each decode switch alone (PDL, each fusion of "
          "kernels/fusions.py) only rounding or wrong, and where: its logits against the path without it and "
          "against the reference rounding where the kernels store, on the same tokens (4 prompts x 32 positions)?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.check_teacher_forced", ("--model", DEPTH_CKPT, "--switches", "all", "--reference", "rounded",
                                               "--prompts", "4", "--steps", "32", "--engine-args",
                                               '{"cudagraph_mode":"FULL_DECODE_ONLY"}'),
                name="v4_depth_switches", timeout_s=540))),
    Suite("teacher_forced_variants", "At V4-Flash depth as shipped, is each kernel variant that decode_variants "
          "finds faster but not bit-equal only rounding or wrong: fp8_cublas_mid on, today's without moe_gemv / "
          "attn_offsets / bf16_gemv (moe_gemv on by default since this suite called it rounding), each against the path without "
          "it and the rounded reference on the same tokens (4 prompts x 32 positions)?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.check_teacher_forced", ("--model", DEPTH_CKPT, "--switches",
                                               "no_moe_gemv,fp8_cublas_mid,no_attn_offsets,no_bf16_gemv", "--reference",
                                               "rounded", "--prompts", "4", "--steps", "32", "--engine-args",
                                               '{"cudagraph_mode":"FULL_DECODE_ONLY"}'),
                name="v4_depth_variants", timeout_s=540)),
          notes="5-8 minutes; a variant within 1.25x the base path's mean KL to the reference is rounding"),
    Suite("teacher_forced_v41", "The same teacher-forced check on the V4.1-Flash-shaped engine as shipped (FP8 "
          "32x32 linears kept as stored, MXFP4 experts, decoder trim on), then with decoder trim off (what the "
          "kernels and graphs alone move).",
          (checkpoint(V41_CKPT, "v41-flash-shaped"),
           Step("tools.check_teacher_forced", ("--model", V41_CKPT), name="v41_shaped", timeout_s=400),
           Step("tools.check_teacher_forced", ("--model", V41_CKPT, "--engine-args", '{"swa_decoder_trim":false}'),
                name="v41_shaped_no_trim", timeout_s=400))),
    Suite("teacher_forced_planted", "Does the teacher-forced check at V4-Flash depth see a planted bug (layer "
          "21's FFN norm 10% off on the engine's side) and name its layer (exit 0 only if every probe does)?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.check_teacher_forced", ("--model", DEPTH_CKPT, "--perturb-layer", "21", "--perturb-scale",
                                               "1.1", "--prompts", "4", "--steps", "64"), name="v4_depth_planted",
                timeout_s=400))),
    # ---- decode and prefill at V4-Flash depth (43 layers, its schedule, 16 MXFP4 experts, FP8 linears)
    Suite("decode_depth", "How far is a decode step at V4-Flash depth, as shipped, from its memory floor "
          "(batch 1 / 32 / 64 / 150, context ~1K, CUDA graphs)?",
          (Step("tools.bench_engine", (*MODEL, "--concurrency", "", "--input-len", "1024", "--floor",
                                       "--steady", "1,32,64,150", "--engine-args", DEPTH), timeout_s=400),),
          preset="flash-depth"),
    Suite("decode_depth_experts", "The regression check of a decode step at V4-Flash depth as shipped, at two expert "
          "counts (16 and 64 routed experts): batch 1 / 32 against the floor (the engine as shipped, decode graphs "
          "only: no mixed-step captures to wait for)?",
          tuple(step for e in (16, 64) for step in (
              expert_checkpoint(e, name=f"checkpoint_e{e}"),
              Step("tools.bench_engine", ("--model", SWITCH_CKPT.format(e=e), "--concurrency", "", "--input-len",
                                          "1024", "--floor", "--steady", "1,32", "--engine-args", SWITCHES),
                   name=f"e{e}", then_remove="flash-depth-e*", timeout_s=300))),
          notes="about 5 minutes on a fresh machine: per expert count a checkpoint (~30 / ~60 s) and an engine "
                "start with decode graphs (~60-90 s), then 64 steps a batch"),
    Suite("decode_switches", "At V4-Flash depth as shipped (16 experts), what does each launch-saving fusion "
          "(kernels/fusions.py) save per step on today's default step (PDL on) at batch 1 and 150, all of them "
          "together at 1 / 32 / 150, and PDL off; how many kernels per layer does each launch? (All six together "
          "saved nothing on 2026-12-06: which of them pays alone?)",
          (expert_checkpoint(16),
           Step("tools.bench_decode_switches", ("--model", SWITCH_CKPT.format(e=16), "--engine-args", SWITCHES,
                                                "--label", "e16"), name="e16", then_remove="flash-depth-e16-*",
                timeout_s=570)),
          notes="about 9 minutes on a fresh machine: a checkpoint, an engine start, then 3 configs at 3 batches and "
                "10 fusions at 2, each a graph capture and 24 steps"),
    Suite("decode_switches_e64", "The same at 64 routed experts: PDL and the fusions off / on together.",
          (expert_checkpoint(64),
           Step("tools.bench_decode_switches", ("--model", SWITCH_CKPT.format(e=64), "--configs", "base,pdl,fuse,all",
                                                "--engine-args", SWITCHES, "--label", "e64"), name="e64",
                then_remove="flash-depth-e64-*", timeout_s=400))),
    Suite("decode_variants", "At V4-Flash depth as shipped (16 experts), per decode step at batch 1 / 32 / 150 with "
          "the same logits (PDL on all), today's step against it without moe_gemv (on by default: the MXFP4 MoE at "
          "1-4 tokens as CUDA-core GEMVs), with wo_a_one_launch on (wo_a's per-group launches at 33-255 rows as one "
          "launch of the same programs: batch 150) and without bf16_gemv (on by default: the compressors' and "
          "indexer's bf16 projections and the router's gate as one CUDA-core GEMV launch with PDL instead of "
          "cuBLAS's split-K GEMM and its reduce, up to 4 rows, so batch 32 / 150 run cuBLAS there), without "
          "attn_offsets (on by default: the CSA attention's wgmma tiles, from 16 tokens, read the key rows from one "
          "table a launch writes first), with fp8_cublas_mid "
          "(cuBLAS's blockwise FP8 GEMM for the FP8 linears from 128 rows, not 256: batch 150), then today's again "
          "(the drift over the run)?",
          decode_ab_steps(DECODE_VARIANT_CONFIGS, 16),
          notes="about 7 minutes on a fresh machine: a checkpoint (~30 s), an engine start with decode graphs "
                "(~60-90 s), then per batch and config a graph capture and 24 steps"),
    Suite("decode_server_128k", "In a server configured for 128K-token contexts (max_model_len 131072: its decode "
          "graphs' indexer rows are 32,768 entries wide, so the selection scores what each token sees: the default past "
          "4,096 entries), V4-Flash depth as shipped (16 experts), how long is a decode step at 1K-token contexts "
          "(batch 1 / 32 / 150) and 8K (batch 1 / 32)? (Against an 8K server's step: decode_variants' pdl row.)",
          (expert_checkpoint(16),
           decode_ab(SWITCH_CKPT.format(e=16), "pdl", SWITCHES_128K, "ctx1k"),
           decode_ab(SWITCH_CKPT.format(e=16), "pdl", SWITCHES_128K, "ctx8k", "--input-len", "8192",
                     "--batches", "1,32", then_remove="flash-depth-e16-*")),
          notes="about 7 minutes on a fresh machine: a checkpoint (~30 s), per context an engine start with decode "
                "graphs (~60-90 s; the 8K one prefills 32 x 8K tokens, ~30 s), then per batch and config a graph "
                "capture and 24 steps"),
    Suite("pdl_paths", "With programmatic dependent launch on, does every served path give what it gives with PDL "
          "off, bit for bit (prefill eager and chunked, mixed-step graphs, decode graphs at batch 1 / 8 / 32, MTP "
          "verify / rollback / draft graphs, DSpark verify / plain-step / drafter / rollback graphs, sampled "
          "tokens)? Passing it is what lets the `pdl` engine argument default to auto.",
          (checkpoint(SHAPED_CKPT, "flash-shaped"), checkpoint(SHAPED_0731_CKPT, "flash-shaped", "--layout", "0731",
                                                               name="checkpoint_0731"),
           Step("tools.check_pdl_paths", ("--model", SHAPED_CKPT, "--dspark-model", SHAPED_0731_CKPT),
                timeout_s=420))),
    Suite("pdl_chain", "What does a kernel boundary cost on this GPU, and how much of it do programmatic dependent "
          "launch (eagerly and in a CUDA graph, with and without a weight prefetch before the wait) and one "
          "persistent kernel waiting on dependency counters save, at 8 and 128 programs a link?",
          (Step("tools.bench_pdl", (), timeout_s=240),)),
    Suite("prefill_ttft", "How far is the one-user TTFT of a 1024-token prompt at V4-Flash depth from its FLOP "
          "floor, what does one token more cost (1025: a 1024-token text and its BOS, past the 1024-token graph), "
          "and where does a 4 x 1024-token prefill spend its time?",
          (Step("tools.bench_engine", (*MODEL, "--concurrency", "1", "--input-len", "1024", "--output-len", "8",
                                       "--requests-per-user", "3", "--floor", "--engine-args", DEPTH),
                timeout_s=300),
           Step("tools.bench_engine", (*MODEL, "--concurrency", "1", "--input-len", "1025", "--output-len", "8",
                                       "--requests-per-user", "3", "--engine-args", DEPTH), name="ttft_1025",
                timeout_s=240),
           profile("profile_prefill", *MODEL, "--batch", "4", "--steps", "1", "--prompt-len", "1024", "--rows", "40",
                   "--ops")),
          preset="flash-depth"),
    Suite("prefill_ttft_experts", "How far is the one-user TTFT of a 1024-token prompt at V4-Flash depth from its "
          "FLOP floor at 64 routed experts (96 rows per expert: the MoE's frag tile) beside 16 (384: the grouped "
          "path), and of an 8,192-token prompt at both (issue 40's 1.6x target)?",
          tuple(step for e in (16, 64) for step in (
              expert_checkpoint(e, name=f"checkpoint_e{e}"),
              *(Step("tools.bench_engine", ("--model", SWITCH_CKPT.format(e=e), "--concurrency", "1", "--input-len",
                                            str(n), "--output-len", "8", "--requests-per-user", reqs, "--floor",
                                            "--engine-args", DEPTH_8K), name=f"e{e}_{n}",
                     then_remove="flash-depth-e*" if n == 8192 else None, timeout_s=300)
                for n, reqs in ((1024, "3"), (8192, "2"))))),
          notes="about 8 minutes on a fresh machine: per expert count a checkpoint and two engine starts"),
    Suite("quant_vs_bf16_depth", "Does V4-Flash as shipped (FP8 + MXFP4) decode faster than the same depth in bf16, "
          "online and per step against each floor?",
          tuple(Step("tools.bench_engine", ("--preset", "{preset}", "--quant", q, "--cache-dir", "{ckpt}",
                                            "--concurrency", "1,32,150", "--input-len", "512", "--output-len", "32",
                                            "--requests-per-user", "1", "--floor", "--steady", "1,32,150",
                                            "--label", f"depth-{q}", "--engine-args", DEPTH),
                     name=f"depth_{q}", then_remove="flash-depth*", timeout_s=300)  # 46 GB in bf16: one at a time
                for q in ("fp8-fp4", "bf16")),
          preset="flash-depth"),
    Suite("mixed_budget", "Which chunked-prefill token budget keeps ITL within 2x of the decode step at 64 users, "
          "and what do mixed-step CUDA graphs save per step?",
          (Step("tools.bench_mixed", (*MODEL, "--budgets", "256,512,1024,2048", "--step-budgets", "512,2048",
                                      "--users", "64", "--requests-per-user", "2", "--input-len", "1024",
                                      "--output-len", "128", "--engine-args", MIXED), timeout_s=570),),
          preset="flash-depth"),
    # one engine for every row (start-up and graph capture ~135 s), then 2 requests per user: ~45 s per row at
    # 150 users (~300k prefill tokens at ~8k tok/s), ~25 s at 64; the third policy last, so a call cut short
    # still compares fixed with the default adaptive target at both levels
    Suite("mixed_adaptive", "At V4-Flash depth (1024 in / 128 out, 64 and 150 users, the engine's own step loop), "
          "what does the adaptive chunk budget (engine/chunk_budget.py, ITL target 2x and 4x the full batch's "
          "decode step) give against the fixed 2048 budget: output tok/s, TTFT p50 / p90, ITL p50 / p90?",
          (checkpoint(DEPTH_CKPT, "flash-depth"), closed_loop("2048", "fixed,adaptive,adaptive:4", "64,150", 420)),
          notes="about 7 minutes on a fresh machine: checkpoint ~60 s, engine start ~135 s, six rows ~210 s"),
    # vLLM's and SGLang's servers default to 8192-token chunks on such cards; ours is 2048. A bigger step pays its
    # fixed costs (the MXFP4 experts' unpack, ~15 ms a prefill step at depth; the decode rows) over more prompt
    # tokens, at the price of a longer step for the running decodes: the rows say which wins, and what ITL costs
    Suite("mixed_budget_large", "At V4-Flash depth (1024 in / 128 out, 64 and 150 users, the engine's own step loop), "
          "what do fixed budgets of 4096 and 8192 tokens give against 2048, and the adaptive budget (ITL target 4x the "
          "full batch's step) under the 8192 cap: output tok/s, TTFT p50 / p90, ITL p50 / p90?",
          (checkpoint(DEPTH_CKPT, "flash-depth"), closed_loop("2048,4096,8192", "fixed,adaptive:4", "150,64", 540)),
          notes="about 8 minutes on a fresh machine: checkpoint ~60 s, engine start with graphs up to 8192 tokens "
                "~150 s, eight rows ~280 s (150 users first: the serving target's level; fixed before adaptive)"),
    Suite("graphs_check", "Do CUDA-graph steps (decode and mixed) equal the same padded batches run eagerly, "
          "and if not, which layer and cache write part first?",
          (Step("tools.bench_mixed", (*MODEL, "--check-only", "--step-budgets", "512", "--budgets", "512",
                                      "--users", "8", "--engine-args", MIXED), timeout_s=300),),
          preset="flash-depth"),
    Suite("largest_model", "Does the largest V4-Flash-shaped model one H200 holds (43 layers, 128 MXFP4 experts, "
          "~85 GB) load, decode near its floor and serve through Triton?",
          (checkpoint("{ckpt}/flash-depth-e128-fp8-fp4", "flash-depth", "--override", '{"n_routed_experts":128}',
                      "--spill-dir", "/dev/shm/ckpt"),
           Step("tools.bench_engine", ("--model", "{ckpt}/flash-depth-e128-fp8-fp4", "--concurrency", "",
                                       "--steady", "1,32,150", "--floor", "--label", "largest", "--engine-args",
                                       DEPTH), timeout_s=300),
           sweep("largest-triton", "{ckpt}/flash-depth-e128-fp8-fp4", DEPTH, "--concurrency", "1,32",
                 "--input-len", "512", "--output-len", "64", "--duration", "15", timeout_s=300))),
    # ---- serving through Triton
    Suite("serving_triton", "How close is the engine through the real Triton server to the same engine called "
          "directly (flash-shaped, 1 / 32 / 150 users, 512 in / 64 out)?",
          (Step("tools.make_tiny_checkpoint", ("{ckpt}/flash-shaped", "--preset", "flash-shaped", "--device",
                                               "cuda"), name="checkpoint", json_flag=None,
                unless_exists="{ckpt}/flash-shaped/config.json"),
           sweep("triton", "{ckpt}/flash-shaped", SHAPED, "--concurrency", "1,32,150", "--input-len", "512",
                 "--output-len", "64", "--duration", "20", timeout_s=300),
           Step("tools.bench_engine", ("--model", "{ckpt}/flash-shaped", "--core-process", "--concurrency",
                                       "1,32,150", "--input-len", "512", "--output-len", "64",
                                       "--requests-per-user", "4", "--engine-args", SHAPED),
                name="engine_direct", timeout_s=250))),
    # each fits one 600 s device call (machine start apart): the estimates are the 2026-12-04 runs' step times
    # (checkpoint 17 s, engine-direct 140-150 s of which ~135 s start-up, a sweep ~35 s start-up + its levels)
    serving_vs_engine("serving_vs_engine", SHAPED_SERVING, "h200", legs=("engine",),
                      notes="about 6.5 minutes: checkpoint 20 s, engine-direct ~225 s (~135 s start-up + 4 levels "
                      "of 20 s), Triton ~135 s (~35 s start-up + 4 levels of 20 s)"),
    Suite("serving_ttft", "Where do one user's first-token milliseconds go through Triton (flash-shaped, 512 in): "
          "engine-direct TTFT, against the client's TTFT through Triton and the model's own split into queue "
          "(up to the core's scheduling) and prefill?",
          (SHAPED_SERVING.make_model,
           Step("tools.bench_engine", ("--model", "{ckpt}/flash-shaped", "--core-process", "--concurrency", "1",
                                       "--input-len", "512", "--output-len", "4", "--requests-per-user", "40",
                                       "--engine-args", SHAPED), name="engine_direct", timeout_s=240),
           Step("tools.profile_serving", ("--ttft", "--model", "{ckpt}/flash-shaped", "--engine-args", SHAPED,
                                          "--input-len", "512", "--requests", "40"), name="triton",
                python="triton", timeout_s=240)),
          notes="about 4 minutes: checkpoint 20 s, engine-direct 150 s, Triton 60 s"),
    Suite("serving_hops", "Where does the Triton path spend each token's time (flash-shaped, 512 in / 64 out, 1, "
          "32 and 150 users): every hop from the client's send through Triton's execute, the front and the engine core back "
          "through the response threads to the client, and each Triton-stub thread's CPU per output token?",
          (SHAPED_SERVING.make_model,
           Step("tools.profile_serving", ("--hops", "--model", "{ckpt}/flash-shaped", "--engine-args", SHAPED,
                                          "--input-len", "512", "--max-tokens", "64", "--users", "1,32,150",
                                          "--requests", "20"), name="hops", python="triton", timeout_s=360),
           # the same 32 users with twice the response threads: do sends or the stub's GIL pace delivery?
           Step("tools.profile_serving", ("--hops", "--model", "{ckpt}/flash-shaped", "--engine-args",
                                          SHAPED[:-1] + ',"response_threads":8}', "--input-len", "512",
                                          "--max-tokens", "64", "--users", "32", "--requests", "20"),
                name="hops_8_senders", python="triton", timeout_s=300)),
          notes="about 4 minutes: checkpoint 20 s, two server starts 35 s each, the levels 100 s"),
    serving_vs_engine("serving_vs_openai", SHAPED_SERVING, "h200", legs=("openai",),
                      notes="about 5 minutes: checkpoint 20 s, Triton ~135 s, OpenAI ~135 s"),
    serving_vs_engine("serving_vs_engine_depth", DEPTH_SERVING, "h200", legs=("engine",),
                      notes="about 7.5 minutes: checkpoint ~30 s, engine-direct ~275 s (~180 s start-up + 2 levels of "
                      "15 s warm-up + 30 s counted, in-flight requests cancelled), Triton ~160 s (~55 s start-up, its JIT "
                      "cache warm, + 2 levels of 45 s); alone in a call"),
    Suite("serving_depth", "At V4-Flash depth as shipped, with 64 users through Triton (1024 in / 128 out, 90 s): "
          "is ITL p50 within 2x of the batch-64 decode step and TTFT p90 within 4x of p50?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.bench_engine", ("--model", DEPTH_CKPT, "--concurrency", "", "--steady", "64",
                                       "--input-len", "1024", "--engine-args", DEPTH), name="steady64",
                timeout_s=200),
           sweep("depth-triton-64", DEPTH_CKPT, DEPTH, "--concurrency", "64", "--input-len", "1024",
                 "--output-len", "128", "--duration", "90", "--stop-timeout", "30"))),
    Suite("interactivity_depth", "At V4-Flash depth through Triton, how much output per GPU does the optimized "
          "engine give over its own baseline at a fixed tok/s per user (150, or the baseline's best)?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           sweep("depth-optimized", DEPTH_CKPT, DEPTH, "--concurrency", "1,32,64,150", "--input-len", "1024",
                 "--output-len", "128", "--duration", "20", timeout_s=300),
           # the baseline's step at this depth is ~0.76 s: one user, a window one request fits in, and the wait
           sweep("depth-baseline", DEPTH_CKPT, DEPTH[:-1] + ',"kernels":"ref","enforce_eager":true,'
                 '"enable_prefix_caching":false,"async_scheduling":false}', "--concurrency", "1", "--input-len",
                 "1024", "--output-len", "128", "--duration", "40", "--stop-timeout", "150", timeout_s=320),
           Step("loadtest.interactivity", ("{out}/depth-optimized.json", "{out}/depth-baseline.json", "--at", "150"),
                name="ratio", timeout_s=60))),
    *(depth_curve(c, f"The headline serving table at V4-Flash depth as shipped, through the real Triton server "
                     f"(closed loop, gRPC streaming, client processes that are not the limit): 1024 in / 128 out at "
                     f"{c.levels.replace(',', ' / ')} users: output tok/s (per GPU), tok/s per user, TTFT p50 / p90, "
                     "ITL p50, and the curve read at 20 and 50 tok/s per user?", CURVES_1K)
      for c in CURVES_1K),
    *(depth_curve(c, f"The headline serving table at V4-Flash depth as shipped, through Triton: 8K in / 1K out at "
                     f"{c.levels.replace(',', ' / ')} users: output tok/s (per GPU), tok/s per user, TTFT p50 / p90, "
                     "ITL p50, and the curve read at 20 and 50 tok/s per user?", CURVES_8K)
      for c in CURVES_8K),
    depth_curve(CURVE_AGENTIC, "The headline serving table at V4-Flash depth as shipped, through Triton, on the agentic "
                "multi-turn workload (a 4096-token system prompt, 6 turns of 128-384 tokens, 128-384-token replies, "
                "prefix caching on) at 8 / 32 / 64 users: output tok/s (per GPU), tok/s per user, TTFT, the "
                "prefix-cache hit ratio, and the curve read at 20 and 50 tok/s per user?"),
    Suite("serving_v41", "How does V4.1-Flash-shaped serve through the real Triton server at 1 / 32 / 150 users "
          "(512 in / 64 out)?",
          (checkpoint(V41_CKPT, "v41-flash-shaped"),
           sweep("v41-triton", V41_CKPT, V41_SERVE, "--concurrency", "1,32,150", "--input-len", "512",
                 "--output-len", "64", "--duration", "30"))),
    # ---- the engine on the 4-layer flash-shaped checkpoint
    Suite("optimized_vs_baseline", "How much faster is the default engine than its own baseline (reference "
          "kernels, eager, no prefix cache, sync), online and decode-only, and do graphs match eager?",
          (Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency",
                                       "1,8,32,64,150", "--input-len", "512", "--output-len", "64",
                                       "--requests-per-user", "1", "--floor", "--check-graphs", "--steady",
                                       "1,32,150", "--engine-args", SHAPED), name="optimized"),
           Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency", "1,32,150",
                                       "--input-len", "512", "--output-len", "64", "--requests-per-user", "1",
                                       "--baseline", "--engine-args", SHAPED), name="baseline")),
          preset="flash-shaped"),
    Suite("async_scheduling", "What does overlapping the host's work with the GPU's step (async scheduling) buy, "
          "online and per steady decode step, and per step for sampled requests (temperature 0.8, top-p 0.95: drawn "
          "on the device, so they stay in flight too)?",
          (*(Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency",
                                         "1,32,150", "--input-len", "512", "--output-len", "64",
                                         "--requests-per-user", "1", "--steady", "1,32,150", "--label", name,
                                         "--engine-args", SHAPED[:-1] + f',"async_scheduling":{flag}}}'),
                  name=name)
             for name, flag in (("async", "true"), ("sync", "false"))),
           *(Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency", "",
                                         "--input-len", "512", "--steady", "1,32,150", "--sampling",
                                         '{"temperature":0.8,"top_p":0.95}', "--label", name,
                                         "--engine-args", SHAPED[:-1] + f',"async_scheduling":{flag}}}'),
                  name=name)
             for name, flag in (("sampled_async", "true"), ("sampled_sync", "false")))),
          preset="flash-shaped"),
    Suite("vs_transformers", "How does the engine compare with transformers' eager generate on the same "
          "checkpoint (TTFT of 1024 tokens, decode at batch 1 / 8 / 32)?",
          (Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency", "1",
                                       "--input-len", "1024", "--output-len", "32", "--requests-per-user", "2",
                                       "--hf-peer", "1,8", "--engine-args", SHAPED), name="peer_1024"),
           Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--concurrency", "32",
                                       "--input-len", "512", "--output-len", "32", "--requests-per-user", "1",
                                       "--hf-peer", "32", "--engine-args", SHAPED), name="peer_512")),
          preset="flash-shaped"),
    Suite("prefix_cache_agentic", "How much TTFT does bounded replay save on a multi-turn agentic workload, "
          "against no prefix cache and against window snapshots?",
          tuple(Step("tools.bench_engine", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--workload",
                                            "agentic", "--concurrency", "4", "--turns", "4", "--input-len", "2048",
                                            "--turn-len", "256", "--output-len", "16", "--label", mode,
                                            "--engine-args", SHAPED[:-1] + f',"enable_prefix_caching":{pc},'
                                            f'"swa_bounded_replay":{rp}}}'), name=mode)
                for mode, pc, rp in (("none", "false", "true"), ("snapshot", "true", "false"),
                                     ("replay", "true", "true"))),
          preset="flash-shaped"),
    Suite("structured_output", "What do JSON-schema-constrained rows add to a decode step at batch 1 / 32 / 150?",
          (Step("tools.bench_structured", ("--preset", "{preset}", "--cache-dir", "{ckpt}", "--steps", "30"),
                timeout_s=300),),
          preset="flash-shaped", notes="--preset tiny runs it on the CPU"),
    # ---- speculative decoding
    Suite("spec_decode", "What do MTP speculative decoding's draft and verify steps cost at V4-Flash depth, and "
          "what speed-up do they give end to end at acceptance 0 (random MTP) and 1 (forced)?",
          (Step("tools.bench_spec", (*MODEL, "--batches", "1,8,32", "--input-len", "512", "--output-len", "48",
                                     "--engine-args", SPEC), timeout_s=300),),
          preset="flash-depth"),
    Suite("dspark", "What do DSpark's (0731) verify, rollback and draft steps cost under CUDA graphs at V4-Flash "
          "depth as shipped (16 experts) at batch 1 / 8 / 32 (and a step that verifies nothing: the plain decode "
          "graph with the target features, the drafter's keys), what speed-up do they model at acceptance lengths "
          "2 / 3 / 4.4 / 5.4 against MTP k = 1 and 3, and what do random (acceptance ~0) drafts give end to end with "
          "the acceptance gate off (the raw overhead) and on (as served), and forced (~1) drafts with it on?",
          (checkpoint(DSPARK_CKPT, "flash-depth", "--layout", "0731"),
           Step("tools.bench_spec", ("--method", "dspark", "--model", DSPARK_CKPT, "--batches", "1,8,32",
                                     "--input-len", "512", "--output-len", "128", "--reps", "5", "--engine-args", SPEC),
                timeout_s=420)),
          notes="verify, rollback and drafter steps replay CUDA graphs (engine/spec/dspark_graphs.py); the micro "
                "times verify_k*_ms / draft_ms as graphs and *_eager_ms eagerly; stage_row_ms (the MTP proxy) as a "
                "graph; rollback_launches: the profiler's count of the rollback graph's kernels and copies; "
                "plain_features_ms / plain_draft_ms / plain_keys_ms: a step that verifies nothing "
                "(engine/spec/plain_graphs.py); end to end dspark_ungated_* (gate off), dspark_* (served), forced_*, "
                "*_steps_without_verify, *_backoffs"),
    Suite("dspark_e64", "The same DSpark figures at 64 routed experts (the draft stages' too), a held-out expert "
          "count: does the gate keep the overhead at acceptance 0 under 20% where a verify's rows read more experts?",
          (checkpoint(DSPARK_E64_CKPT, "flash-depth", "--layout", "0731", "--override", '{"n_routed_experts":64}'),
           Step("tools.bench_spec", ("--method", "dspark", "--model", DSPARK_E64_CKPT, "--batches", "1,8,32",
                                     "--input-len", "512", "--output-len", "128", "--reps", "5", "--engine-args", SPEC),
                then_remove="flash-depth-0731-e64-*", timeout_s=480))),
    Suite("profile_spec", "Where does a speculative step's time go at V4-Flash depth (batch 1, k = 3): the host "
          "under cProfile, then the GPU's kernels?",
          tuple(profile(name, *MODEL, "--batch", "1", "--steps", "48", "--rows", "45", *host, "--engine-args",
                        '{"speculative_config":{"method":"mtp","num_speculative_tokens":3},'
                        '"cudagraph_mode":"FULL_DECODE_ONLY"}')
                for name, host in (("host", ("--host",)), ("gpu", ()))),
          preset="flash-depth"),
    # ---- DeepSeek-V4.1
    Suite("v41_replay", "V4.1-Flash-shaped: how much TTFT does decoder-side bounded replay save at 1K / 8K / 32K, "
          "graphed and eager, how far is decode from its floor, and do graph steps match eager?",
          (Step("tools.bench_deepseek_v41", ("--cache-dir", "{ckpt}", "--reps", "1", "--eager-steps", "4"),
                then_remove="v41-*", timeout_s=560),)),
    Suite("check_v41", "Does the V4.1-Flash-shaped engine as shipped (FP8 32x32 linears kept as stored) agree "
          "with the torch references through prefill, mixed and decode steps?",
          (checkpoint(V41_CKPT, "v41-flash-shaped"),
           Step("tools.bench_engine", ("--model", V41_CKPT, "--concurrency", "", "--check-kernels",
                                       "--engine-args", V41), name="check_kernels", timeout_s=250))),
    Suite("check_v4", "Do the fused kernels each match their torch references on the GPU, and does the 4-layer "
          "V4 engine as shipped agree with the references run eagerly?",
          (Step("tools.bench_fused", ("--only", "align"), name="fused_check", timeout_s=200),
           Step("tools.bench_engine", (*MODEL, "--concurrency", "", "--check-kernels", "--engine-args", SHAPED),
                name="check_kernels", timeout_s=250)),
          preset="flash-shaped"),
    # ---- kernels alone
    Suite("kernels_fp8", "How fast are the FP8 linear kernels against their memory floors, and does keeping FP8 "
          "as stored beat cuBLAS bf16 on the same weight (V4 128x128 and V4.1 32x32 blocks)?",
          (Step("tools.bench_fused", ("--only", "fp8"), name="fused_fp8", timeout_s=300),
           Step("tools.bench_fp8_vs_bf16", ("--rows", "1,32,256,1024,2048"), timeout_s=200),
           Step("tools.bench_quant", ("--v41", "--quick", "--budget", "130"), name="sweep_v41", timeout_s=200))),
    Suite("kernels_fp8_mid", "Which tiles of the FP8 linear kernels are fastest for V4's four FP8 linears at a big "
          "decode batch's 96-256 rows (128-row tiles beside the 64-row ones the tables hold; at 150 rows the tables' "
          "kernels measured slower than bf16 cuBLAS reading twice the bytes), each checked against the reference, "
          "against cuBLAS's blockwise FP8 and bf16 on the same weights?",
          (Step("tools.bench_quant", ("--linear-rows", "96,128,150,192,256", "--budget", "420"), name="sweep",
                timeout_s=480),
           Step("tools.bench_fp8_vs_bf16", ("--rows", "96,128,150,192,256", "--only", "v4"), name="vs_cublas",
                timeout_s=200)),
          notes="5-8 minutes; `--write-configs` on the sweep's command merges its 150-row winners into the tables' "
                "65-512-row entries (kernels/tuned_configs.ROW_BOUNDS; cuBLAS takes 256 rows and more)"),
    Suite("kernels_mxfp4", "How close do the MoE kernels (MXFP4 and FP8 experts) come to their floors at decode "
          "and prefill sizes, per launch config?",
          (Step("tools.bench_quant", ("--moe-only", "--budget", "330"), timeout_s=400),)),
    Suite("kernels_mx_ab", "Does the MXFP4 MoE decoding straight into the tensor cores' operand registers "
          "(bf16-frag, two multiplies a value pair or one; bf16-frag16, the same from weights arranged lane-major at "
          "load: 16-byte copies) or, at one row, as CUDA-core GEMVs (moe_gemv) beat the engine's table tile on the "
          "same launch, at decode (1 / 32 / 150 rows; 16 experts, then 256) and prefill (2048 / 8192 tokens; there "
          "also two 8-warp tiles of twice the work), each checked against the reference first?",
          (Step("tools.bench_quant", ("--mx-ab", "--budget", "200"), timeout_s=270),),
          notes="about 4 minutes; the quick A/B before decode_variants (the same decode at depth, in the engine); "
                "prefill's grouped path to read the fused rows against: moe_dispatch"),
    Suite("kernels_indexer", "One CSA layer's indexer selection at decode (1 / 32 / 150 tokens) and on a prefill chunk "
          "(the last 2,048 tokens of 2K / 8K / 32K-token prompts): today's (every entry of the row scored, then a "
          "sort or torch.topk) against indexer_select (each token scores what it sees, sorts those or past 2,048 "
          "radix-selects), at the row "
          "widths of 8K / 128K / 1M-token servers and 1K / 8K / 64K-token contexts, each pair checked to pick the "
          "same set?",
          (Step("tools.bench_indexer", (), timeout_s=300),),
          notes="about 2 minutes: 24 sizes x 2 paths, 8 calls a CUDA graph"),
    Suite("kernels_sample_draw", "A sampled row's draw at V4-Flash's vocabulary (129,280) for 1-150 rows: the "
          "kernels (kernels/fused_draw.py, one program a row; kernels/fused_draw_wide.py, a row over many programs: "
          "top-k's and top-p's cuts found by searching values, no sort) against their torch reference (sort, "
          "cumsum), as CUDA-graph replays, for temperature alone, top-p 0.95, top-k 50, both, min_p 0.05, each "
          "checked to draw the same token from the same kept set? Which is fastest where (K.sample_draw runs the wide "
          "one)? Which of the one-program kernel's sizes is fastest?",
          (Step("tools.bench_sample_draw", ("--sweep",), timeout_s=300),),
          notes="a few minutes; bf16-rounded rows (ties) with a few likely tokens"),
    Suite("kernels_bf16_gemv", "Is the bf16 GEMV (kernel variant bf16_gemv) right and faster than cuBLAS on V4-Flash's "
          "bf16 linears at decode (a CSA layer's stacked readers of the attention input, an HCA layer's, the indexer's "
          "wq_b, the MoE router's gate at 16 and 256 experts) at 1 / 2 / 4 / 8 rows, against the bytes' floor?",
          (Step("tools.bench_bf16_gemv", (), timeout_s=150),),
          notes="about a minute; then decode_variants (the same at depth, in the engine)"),
    Suite("kernels_quant", "The FP8 GEMM and MoE launch-config sweep: every candidate checked against the torch "
          "reference, timed in CUDA-graph replays against max(bytes, FLOPs) floors.",
          (Step("tools.bench_quant", ("--budget", "220"), timeout_s=300),)),
    Suite("kernels_prefill", "At prefill sizes, do cuBLAS's blockwise FP8 GEMM and the unpacked-expert grouped "
          "GEMM beat the fused kernels they replace?",
          (Step("tools.bench_fp8_vs_bf16", ("--rows", "128,256,512,1024,2048", "--only", "v4"), timeout_s=150),
           Step("tools.bench_moe_prefill", ("--experts", "16", "--fmt", "mxfp4"), timeout_s=150))),
    Suite("moe_dispatch", "From how many rows per expert does the unpacked-expert grouped GEMM beat the fused "
          "MXFP4 MoE kernels at prefill, per expert count (16 / 64 / 128 / 256, top-6, V4-Flash's expert shape), "
          "the rule quant_configs.MOE_GROUPED_MIN_ROWS holds? (Past 32 experts the grouped path runs in chunks of "
          "experts whose unpacked weights fit its scratch bound, as the engine runs it.)",
          (Step("tools.bench_moe_prefill", ("--experts", "16,64,128,256", "--rows-per-expert",
                                            "16,32,64,96,128,192,256,384,512", "--fmt", "mxfp4"), timeout_s=300),),
          notes="about 3 minutes: weights ~10 s, the kernels' compiles ~1-2 min, 36 sizes x 2 paths in graph "
                "replays; the fitted entry is printed for quant_configs.MOE_GROUPED_MIN_ROWS"),
    # kernels_mx_ab's one point (256 experts, 8192 tokens: 192 rows per expert): the 128 x 128 frag tile 11.4 ms,
    # the table's 16.0, the grouped path 14.7 (H100, docs/perf/h100-2026-12-07/): a fused MoE without the unpack
    Suite("moe_prefill_tiles", "Do 8-warp fused MXFP4 tiles that decode straight into the MMA's registers (128 pairs "
          "x 128 weight rows, 256 x 64) beat both the table's fused tile and the unpacked grouped GEMM at prefill, "
          "and where (16 / 64 / 128 / 256 experts, 64-512 rows per expert, each checked against the reference)?",
          (Step("tools.bench_moe_prefill", ("--experts", "16,64,128,256", "--rows-per-expert",
                                            "64,96,128,192,256,384,512", "--fmt", "mxfp4", "--tiles",
                                            "128x128x128w8s3:bf16-frag,256x64x128w8s3:bf16-frag"), timeout_s=420),),
          notes="about 6 minutes: moe_dispatch's sizes from 64 rows per expert with two more fused tiles each"),
    Suite("attention", "How fast is the paged attention kernel on a 2048-token chunk (per tile swept; on CSA "
          "layers also with attn_offsets, the slots' key rows read from one table) and at decode sizes with the "
          "default dispatch, against its FLOP floor?",
          (Step("tools.bench_attention_prefill", (), timeout_s=330),)),
    Suite("kernels_fused", "Does every fused kernel match its torch reference on the GPU, and how fast is it "
          "against its floor and the path it replaced?",
          (Step("tools.bench_fused", (), timeout_s=330),)),
    Suite("kernels_compress", "How much faster are the compressors' multi-row fused kernels than the torch ops "
          "they replace (verify and prefill sizes)?",
          (Step("tools.bench_fused", ("--only", "compress"), timeout_s=240),)),
    Suite("kernels_small", "Are the small fused ops (norms, RoPE, mHC, router, attention, MoE) faster than torch "
          "eager and torch.compile, and how far from their floors?",
          (Step("tools.bench_kernels", ("--batches", "1,8,32,128,256", "--no-compile"), name="eager",
                timeout_s=200),
           Step("tools.bench_kernels", ("--batches", "32",), name="compile", timeout_s=240))),
    Suite("prefill_small_ops", "How far from their floors are prefill's norm + RoPE and mHC mix partials, today's "
          "kernels against their variants (kernels/variants.py: rope_tiles, mix_bf16x3) at 1 / 32 / 150 / 2048 / "
          "8192 tokens of V4-Flash's shapes, do the variants give today's values on the GPU, and which tiles are "
          "fastest at prefill?",
          (Step("tools.bench_prefill_ops", (), timeout_s=300),),
          notes="about 1-2 minutes, no checkpoint (41 s on an H100, 2026-12-06): the check and the A/B at five "
                "sizes, the rope rows and mix tiles sweeps at 2048 / 8192 tokens (every candidate checked); a "
                "variant becomes the default (variants.DEFAULT) where it is right and wins"),
    Suite("prefill_unpack", "How close to its memory floor is the MXFP4 experts' unpack to bf16 (the prefill MoE's "
          "grouped path, once per layer and call: 16 experts of V4-Flash's shape), and which tile is fastest?",
          (Step("tools.bench_unpack", (), timeout_s=240),),
          notes="about 1 minute, no checkpoint: the table's tile against the formats' dequantizer, then 22 tiles "
                "each checked equal and timed; the fastest printed for kernels.mxfp4_unpack.UNPACK_TILES"),
    Suite("prefill_variants", "At V4-Flash depth as shipped, what do today's default (rope_tiles + bf16_gemv + "
          "attn_offsets: the CSA attention's key rows read from one table) without attn_offsets, and with "
          "indexer_select (off: the indexer's picks from what each token sees) do to prefill's time to first token "
          "at 1 x 1024, 4 x 1024 and 1 x 8192 tokens, and are the first tokens the same?",
          (checkpoint(DEPTH_CKPT, "flash-depth"),
           Step("tools.bench_prefill_variants", ("--model", DEPTH_CKPT, "--sets", PREFILL_VARIANT_SETS, "--shapes",
                                                 "1x1024,4x1024,1x8192", "--rounds", "5", "--engine-args",
                                                 '{"max_model_len":8320}'), timeout_s=480)),
          notes="about 3-4 minutes on a fresh machine: the checkpoint (~30-60 s), an engine start with decode "
                "graphs only (~90-150 s), then 6 rounds (one warm-up) x 4 sets of the three prefills (~0.1 + 0.3 "
                "+ 0.6 s): ~30 s"),
    # ---- several GPUs
    Suite("tp_share", "How long is rank 0's share of V4-Flash as shipped at tensor_parallel_size 8 (collectives "
          "skipped), the compute term of the multi-GPU projection?",
          (Step("tools.bench_tp_share", ("--world", "8", "--batches", "1,32,150", "--input-len", "512",
                                         "--chunk", "2048"), timeout_s=420),)),
    Suite("tp_share_switches", "At rank 0's share of V4-Flash as shipped at tensor_parallel_size 8 (256 experts, 32 "
          "of them and 8 of 64 heads a rank, collectives skipped), where ~1,500 small kernels a step set the time, "
          "which launch-saving switches pay: every fusion together and each alone on today's step (PDL on) at "
          "batch 1, all of them and today's without moe_gemv (on by default: the MoE's few rows as CUDA-core GEMVs) "
          "at 1 / 32 / 150, the logits "
          "compared, kernels a layer counted?",
          (Step("tools.bench_decode_switches", ("--tp-share", "8", "--experts", "256", "--batches", "1,32,150",
                                                "--single-batches", "1", "--configs", TP_SHARE_SWITCH_CONFIGS,
                                                "--engine-args", SWITCHES, "--label", "tp8"),
                name="tp8", timeout_s=570),),
          notes="about 6-8 minutes on a fresh machine: the share built in memory (~20 s), an engine start with "
                "decode graphs (~60-90 s), then 3 configs at 3 batches and 10 fusions at batch 1, each a graph "
                "capture and 24 steps of ~8-35 ms"),
    Suite("v41_share", "How long is rank 0's share of V4.1-Flash at its released size (384 MXFP4 experts, Engram "
          "tables of 384M rows, the rank's rows in host RAM) at tensor_parallel_size 8 and 4 (collectives skipped): "
          "decode at batch 1/32/150 against its floor, TTFT 1K/8K, the Engram gather alone, and what host tables cost against device tables (same rows, same graphs)?",
          tuple(Step("tools.bench_v41_share", ("--worlds", w, "--batches", "1,32,150", "--ttft", "1024,8192",
                                               "--input-len", "512", *check), name=f"world{w}", timeout_s=295)
                for w, check in (("8", ("--check",)), ("4", ())))),  # --check: host tables equal device tables
    # ---- profiles (text tables: the step's output)
    Suite("profile_decode_depth", "Where does a decode step at V4-Flash depth as shipped go, kernel by kernel, "
          "at batch 1 and 150, with PDL on and off (with it on, a kernel's time includes its wait on the one before)?",
          tuple(profile(name, *MODEL, "--batch", b, "--steps", "48", "--rows", "45", *extra)
                for name, b, extra in PROFILE_ROWS),
          preset="flash-depth"),
    Suite("profile_tp_share", "Where does a decode step of rank 0's share of V4-Flash at tensor_parallel_size 8 go "
          "(256 experts, 32 a rank; collectives skipped), kernel by kernel, at batch 1 and 150, with PDL on and off "
          "(with it on, a kernel's time includes its wait on the one before)?",
          tuple(profile(name, "--tp-share", "8", "--experts", "256", "--preset", "flash-depth", "--quant", "fp8-fp4",
                        "--batch", b, "--steps", "48", "--rows", "45", *extra)
                for name, b, extra in PROFILE_ROWS),
          notes="about 4 minutes: per step the share built in memory, an engine start, 48 profiled steps"),
    Suite("profile_prefill", "Where does a 4 x 1024-token prefill go, kernel by kernel, at V4-Flash depth and "
          "on V4.1-Flash-shaped?",
          (profile("v4", "--preset", "flash-depth", "--quant", "fp8-fp4", "--cache-dir", "{ckpt}", "--batch", "4",
                   "--steps", "1", "--prompt-len", "1024", "--rows", "45", "--ops",
                   then_remove="flash-depth-*"),
           Step("tools.profile_decode", ("--preset", "v41-flash-shaped", "--quant", "fp8-fp4", "--cache-dir",
                                         "{ckpt}", "--batch", "4", "--steps", "1", "--prompt-len", "1024",
                                         "--rows", "45"), name="v41", json_flag=None, timeout_s=200))),
    Suite("profile_decode_v41", "Where does a V4.1-Flash-shaped decode step at batch 1 go, kernel by kernel?",
          (checkpoint(V41_CKPT, "v41-flash-shaped"),
           profile("batch1", "--model", V41_CKPT, "--batch", "1", "--steps", "48", "--rows", "45"))),
    Suite("profile_decode_shaped", "Where does a batch-1 decode step on the 4-layer flash-shaped checkpoint go: "
          "GPU kernels, then the host's Python?",
          (profile("gpu", "--preset", "{preset}", "--cache-dir", "{ckpt}", "--batch", "1", "--steps", "200",
                   "--rows", "40"),
           profile("host", "--preset", "{preset}", "--cache-dir", "{ckpt}", "--batch", "1", "--steps", "200",
                   "--rows", "30", "--host")),
          preset="flash-shaped"),
    # ---- CPU: the host's own Python and the tiny checkpoint
    Suite("engine_cpu", "How fast is the engine on the tiny checkpoint on the CPU (offline, and online at "
          "1 / 8 / 32 users)?",
          (Step("tools.bench_engine", ("--preset", "{preset}", "--concurrency", "1,8,32", "--input-len", "128",
                                       "--output-len", "32", "--offline", "32", "--engine-args",
                                       '{"dtype":"float32"}')),),
          machine="cpu", preset="tiny"),
    Suite("smoke", "Does the runner work end to end? (the tiny engine, one user, a few seconds on the CPU)",
          (Step("tools.bench_engine", ("--preset", "{preset}", "--concurrency", "1", "--input-len", "16",
                                       "--output-len", "4", "--requests-per-user", "1", "--engine-args",
                                       '{"dtype":"float32","max_model_len":256}'), timeout_s=120),),
          machine="cpu", preset="tiny"),
    Suite("host_python", "How much of a decode step is the engine's own Python at batch 150 (tiny checkpoint, "
          "stop strings on), and how much the outputs?",
          (Step("tools.make_tiny_checkpoint", (".cache/tiny", "--preset", "tiny"), name="checkpoint",
                json_flag=None, unless_exists=".cache/tiny/config.json"),
           Step("tools.profile_host", ("--batch", "150", "--stop-strings"), timeout_s=300)),
          machine="cpu"),
    Suite("server_python", "How much CPU does the server's Python spend per streamed response through a real "
          "Triton server (tiny checkpoint, 32 users)?",
          (Step("tools.profile_serving", ("--users", "32", "--requests", "2", "--max-tokens", "128"),
                python="triton", timeout_s=400),),
          machine="cpu"),
    Suite("response_sends", "How many streamed responses a second can a Triton python model send, from 1 or 4 "
          "threads, beside a thread that keeps the GIL busy, at Python's default switch interval and at 0.5 ms?",
          (Step("tools.bench_response_sends", (), python="triton", timeout_s=300),), machine="cpu",
          notes="also meaningful on the H200 host's 16 cores"),
    serving_vs_engine("serving_vs_engine_cpu", Serving("1,4", "64", "16", "{}", None, None,
                                                       "the tiny checkpoint on the CPU", duration="4"), "cpu"),
    Suite("transport", "How long does handing a step's outputs from the engine core process to the front take?",
          (Step("tools.bench_transport", (), timeout_s=200),), machine="cpu"),
    Suite("front_bodies", "How much memory does the OpenAI front hold, and how long do its small requests wait, "
          "while 16 clients send 16 MiB bodies at once (a stop_token_ids list, a long prompt)?",
          (Step("tools.bench_front_bodies", (), python="triton", timeout_s=300),), machine="cpu"),
    Suite("core_process", "Through Triton on the CPU, what does the engine core in its own process change "
          "against in-process AsyncLLM (tok/s, ITL, CPU seconds per process)?",
          tuple(Step("tools.profile_processes", ("--", "{python}", "-m", "loadtest.sweep", "--serve",
                                                 "--engine-args", f'{{"engine_core_process":{flag}}}',
                                                 "--concurrency", "32,64", "--duration", "30", "--label",
                                                 f"core_process_{flag}", "--out", "{out}"),
                     name=f"core_process_{flag}", python="triton", timeout_s=400)
                for flag in ("false", "true")),
          machine="cpu"),
    Suite("decode_ops", "How many kernels does one decode step launch, per layer kind (counted on the CPU on the "
          "CUDA dispatch)?",
          (Step("tools.count_decode_ops", ("--preset", "tiny", "--quant", "fp8-fp4", "--override",
                                           '{"hidden_size":256,"head_dim":128,"qk_rope_head_dim":64,'
                                           '"q_lora_rank":256,"o_groups":2,"o_lora_rank":256,'
                                           '"moe_intermediate_size":256,"index_head_dim":128,"index_n_heads":4,'
                                           '"num_attention_heads":4}'), name="v4", timeout_s=300),
           Step("tools.count_decode_ops", ("--preset", "v41-tiny", "--by-kind"), name="v41", timeout_s=300)),
          machine="cpu"),
    Suite("replay_error", "How far are the logits after a prefix-cache hit with bounded replay from a cold run's "
          "(tiny, float64)?",
          (Step("engine.replay_error", ("--prompts", "16", "--seeds", "3", "--steps", "8"), timeout_s=600),),
          machine="cpu"),
    Suite("replay_error_v41", "The same on DeepSeek-V4.1's transformers oracle, a prefix-cache hit (encoder side) "
          "and decoder-side replay (float64)?",
          tuple(Step("engine.replay_error", ("--model", "/work/shared/oracles/deepseek_v41/tiny", "--prompts", "8",
                                             "--seeds", "2", "--steps", "8", "--side", side), name=side,
                     timeout_s=600)
                for side in ("encoder", "decoder")),
          machine="cpu", notes="needs the oracle checkpoint at that path"),
]

SUITES: dict[str, Suite] = {s.name: s for s in SUITE_LIST}
assert len(SUITES) == len(SUITE_LIST), "two suites share a name"
