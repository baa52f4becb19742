"""methods/packing.py against a naive bit-by-bit little-endian stream."""

import pytest
import torch

from methods.packing import pack_bits, packed_nbytes, unpack_bits


def naive_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """One row: code j occupies stream bits [j*bits, (j+1)*bits), least significant bit first."""
    n = codes.numel()
    stream = [0] * (packed_nbytes(n, bits) * 8)
    for j, c in enumerate(codes.tolist()):
        for i in range(bits):
            stream[j * bits + i] = (c >> i) & 1
    out = [sum(stream[8 * k + i] << i for i in range(8)) for k in range(len(stream) // 8)]
    return torch.tensor(out, dtype=torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_pack_matches_naive_stream_and_roundtrips(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 1 << bits, (3, n), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_nbytes(n, bits))
    for row in range(3):
        assert torch.equal(packed[row], naive_pack(codes[row], bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    assert torch.equal(unpack_bits(packed, bits, n, dtype=torch.uint8), codes.to(torch.uint8))


def test_rejects_out_of_range_and_float_codes():
    with pytest.raises(ValueError, match="out of range"):
        pack_bits(torch.tensor([[4]]), 2, check=True)
    with pytest.raises(ValueError, match="out of range"):
        pack_bits(torch.tensor([[-1, 0]]), 3, check=True)
    with pytest.raises(TypeError):
        pack_bits(torch.tensor([[1.0]]), 2)
    with pytest.raises(ValueError, match="1..8"):
        pack_bits(torch.tensor([[1]]), 9)


def test_range_check_is_off_by_default_and_syncs_nothing():
    """The check is two device->host syncs per call, so hot paths do not run it."""
    from torch.profiler import ProfilerActivity, profile

    import methods.packing as packing

    codes = torch.randint(0, 4, (2, 64))
    assert not packing.CHECK_CODES  # the test environment does not set KVBENCH_CHECK_CODES
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pack_bits(codes, 2)
        pack_bits(codes, 3)
    names = {e.name for e in prof.events()}
    assert "aten::_local_scalar_dense" not in names and "aten::aminmax" not in names
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pack_bits(codes, 2, check=True)
    assert "aten::_local_scalar_dense" in {e.name for e in prof.events()}
