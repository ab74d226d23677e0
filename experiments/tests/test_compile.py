"""The probes' CUDA sources compile with NVRTC through experiments/cuda.py's include of
probe_common.cuh, with no GPU needed (skipped where no libnvrtc can be loaded; on a CPU machine
`pip install --target DIR nvidia-cuda-nvrtc-cu12` and LD_LIBRARY_PATH=DIR/nvidia/cuda_nvrtc/lib)."""
import pytest

from ddbench.kernels import cuda
from experiments import dataflow, hop_probe
from experiments.cuda import HERE
from experiments.scripts import moe_decode_probe, moe_marlin_variants


def _cubin(source: str, defines: dict, arch: str = "sm_90") -> bytes:
    defines = {**defines, "PROBE_COMMON": f'"{HERE / "probe_common.cuh"}"'}
    return cuda.cubin(str(HERE / source), tuple(sorted(defines.items())), arch)


@pytest.fixture(scope="module", autouse=True)
def nvrtc():
    try:
        cuda._nvrtc()
    except OSError:
        pytest.skip("no libnvrtc on this machine")


@pytest.mark.parametrize("mode", sorted(hop_probe.MODES.values()))
def test_hop_probe_compiles(mode):
    assert len(_cubin("hop_probe.cu", {"MODE": mode})) > 1000


@pytest.mark.parametrize("split, publisher, marks", [(1, 0, 0), (2, 1, 1)])
def test_dataflow_compiles(split, publisher, marks):
    assert len(_cubin("dataflow.cu", {"SLOTS": dataflow.SLOTS, "SLOT": dataflow.SLOT, "KMAX": 7168, "SPLIT": split,
                                      "RB": dataflow.RB, "VECS": dataflow.VECS, "PUBLISHER": publisher,
                                      "MARKS": marks})) > 1000


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_stream_probe_compiles(mode):
    assert len(_cubin("stream_probe.cu", {"MODE": mode, "THREADS": 256, "UNROLL": 4, "STAGES": 4,
                                          "CHUNK": 8192})) > 1000


@pytest.mark.parametrize("variant", sorted(moe_decode_probe.PATCHES))
def test_moe_decode_probe_variants_compile(variant, tmp_path):
    path = tmp_path / f"{variant}.cu"
    path.write_text(moe_decode_probe.patched(variant))
    assert len(cuda.cubin(str(path), (("G", 32), ("H", 7168), ("I", 256), ("KS", 4)), "sm_90")) > 1000


@pytest.mark.parametrize("variant", sorted(moe_marlin_variants.VARIANTS))
@pytest.mark.parametrize("ng, w2b, stages", [(1, 1, 4), (2, 2, 5), (2, 2, 3)])
def test_moe_marlin_variants_compile(variant, ng, w2b, stages, tmp_path):
    path = tmp_path / f"{variant}.cu"
    path.write_text(moe_marlin_variants.VARIANTS[variant][0](moe_marlin_variants.SRC.read_text()))
    defines = {"NG": ng, "W2B": w2b, "STAGES": stages, "WARPS": 4, "G": 32, "H": 7168, "I": 256, "TOPK": 8}
    assert len(cuda.cubin(str(path), tuple(sorted(defines.items())), "sm_90")) > 1000


@pytest.mark.parametrize("group, stages, sizes", [(32, 4, (48, 96, 128)), (64, 2, (48, 96, 128)),
                                                  (128, 6, (48, 96, 128)), (32, 12, (16, 32, 48))])
def test_moe_wgmma_compiles(group, stages, sizes):
    defines = {"STAGES": stages, "N1": sizes[0], "N2": sizes[1], "N3": sizes[2], "G": group, "H": 7168, "I": 256,
               "TOPK": 8}
    assert len(_cubin("moe_wgmma.cu", defines, "sm_90a")) > 1000
