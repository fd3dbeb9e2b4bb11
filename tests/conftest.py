"""Shared fixtures. `triton_server`: one real tritonserver (backend.serve) for the whole session,
serving the tiny checkpoint with the native engine on free loopback ports."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on the CPU through Triton's interpreter; it must be chosen before any
# kernel module is imported (the @triton.jit decorator reads it), so here, first.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One CPU thread per process (this one, the servers and engine processes it starts), unless the caller
# chose: the tiny models' ops are microseconds of work, and on a shared 2-core machine OpenMP's thread
# hand-offs cost far more (tests/engine/test_batching.py: 13 s single-threaded, 144 s with the default
# threads while other processes held the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

@pytest.fixture(autouse=True)
def _kernel_switches_restored():
    """The kernels backend, fusions, variants and PDL are process-wide (an engine's constructor sets its backend):
    a test that changes one must not change the tests after it in the same worker (they compare against goldens).
    Restored to what they were before the test (its module's fixtures set up), or to their defaults where the
    test itself imported kernels."""
    import sys

    def state():
        import kernels
        from kernels import fusions, pdl, variants

        return kernels.backend(), fusions.enabled(), variants.enabled(), pdl.enabled()

    before = state() if "kernels" in sys.modules else None
    yield
    if "kernels" not in sys.modules:
        return
    import kernels
    from kernels import fusions, pdl, variants

    backend, fused, varied, launched = before or (os.environ.get("DSV4_KERNELS", "auto"), fusions.DEFAULT,
                                                  variants.DEFAULT, False)
    if kernels.backend() != backend:
        kernels.set_backend(backend)
    fusions.set_fusions(fused)
    variants.set_variants(varied)
    pdl.set_enabled(launched)


@pytest.fixture(autouse=True)
def _seeded_torch(request):
    """Each test draws the same random numbers every run (its own seed, from its id): a tolerance that a rare draw
    breaks shows on the first run, not as one failure in twenty on CI. A test that seeds its own generator is
    unaffected."""
    import sys
    import zlib

    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(zlib.crc32(request.node.nodeid.encode()))


# Small enough that "prompt longer than max_model_len" is a short string.
SERVER_ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 16}


@pytest.fixture(scope="session")
def triton_server():
    from backend.serve import TritonServer

    with TritonServer(engine_args=SERVER_ENGINE_ARGS, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=300) as server:
        yield server


@pytest.fixture(scope="session")
def openai_server(triton_server):
    """The OpenAI service (backend/openai) in front of `triton_server`, with the checkpoint's chat template."""
    from backend.openai.process import OpenAIProcess, tokenizer_dir

    model_json = triton_server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json"
    with OpenAIProcess(triton_server.grpc_url, port=0, tokenizer=tokenizer_dir(model_json),
                       log_path=triton_server.workdir / "openai.log") as front:
        yield front


@pytest.fixture(scope="module")
def sdk(openai_server):
    """The official openai SDK on the shared OpenAI front."""
    import openai

    with openai.OpenAI(base_url=openai_server.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client
