"""kernels/__init__.py's dispatch: each public op bound to its own reference or its own kernel, per backend."""

import pytest
import torch

import kernels
from kernels import fused, reference
from kernels.deepseek_v41 import reference as v41_reference


@pytest.fixture
def restore_backend():
    yield
    kernels.set_backend("auto")


def _spec(name):
    """The reference an op's name says it has: kernels/reference.py, or V4.1's for `v41_<name>`."""
    if name.startswith("v41_"):
        return getattr(v41_reference, name[len("v41_"):])
    return getattr(reference, name)


def test_ref_binds_each_op_to_its_own_reference(restore_backend):
    kernels.set_backend("ref")
    assert len(kernels.op_names()) == 42
    for name in kernels.op_names():
        assert kernels.reference_of(name) is _spec(name), name
        assert getattr(kernels, name) is _spec(name), name


def test_fused_binds_every_kernel_and_leaves_the_rest_on_references(restore_backend):
    kernels.set_backend("fused")
    assert set(fused.FUSED) <= set(kernels.op_names())  # a kernel under a name no op has would never run
    for name in kernels.op_names():
        assert getattr(kernels, name) is fused.FUSED.get(name, _spec(name)), name


def test_auto_wraps_kernels_once_and_runs_references_on_cpu(restore_backend):
    kernels.set_backend("auto")
    first = {name: getattr(kernels, name) for name in kernels.op_names()}
    kernels.set_backend("ref")
    kernels.set_backend("auto")
    for name in kernels.op_names():
        op = getattr(kernels, name)
        assert op is first[name], name  # a switch back re-binds the same wrappers, not new ones
        assert op is _spec(name) or (op.__wrapped__ is _spec(name) and name in fused.FUSED), name
    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="must be one of .*'reordered'"):
        kernels.set_backend("triton")
    assert kernels.backend() in kernels.BACKENDS
