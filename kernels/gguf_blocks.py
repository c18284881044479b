"""The GGUF (ggml) block formats that deepinfer computes on without dequantizing first.

A quantized GGUF row of K weights is ``K / block_weights`` blocks of ``block_bytes``
bytes, stored back to back, little-endian. This module is the one table of those sizes
that the torch reference, the Triton kernels and the CPU kernels share. The type ids are
ggml's ``GGMLQuantizationType`` values as plain ints: the kernel package depends on
neither deepinfer nor the ``gguf`` package (tests check the table against ``gguf``).

Byte layouts (offsets in bytes; ``f16`` an IEEE half, nibbles low half first):

- ``Q8_0``: d f16 @0, q int8[32] @2; ``w = d * q``
- ``Q4_0``: d @0, qs[16] @2; ``w = d * (q - 8)``
- ``Q4_1``: d @0, m @2, qs[16] @4; ``w = d * q + m``
- ``Q5_0``: d @0, qh u32 @2, qs[16] @6; q = nibble | bit i of qh << 4; ``w = d * (q - 16)``
- ``Q5_1``: d @0, m @2, qh @4, qs[16] @8; ``w = d * q + m``
- ``Q4_K``: d @0, dmin @2, 12 bytes of eight 6-bit (scale, min) pairs @4, qs[128] @16;
  eight sub-blocks of 32: ``w = d * scale_j * q - dmin * min_j``
- ``Q5_K``: as Q4_K, then qh[32] @16 (bit j of byte i: weight i of sub-block j), qs @48
- ``Q6_K``: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; sixteen sub-blocks
  of 16: ``w = d * scale_j * (q - 32)``, q 6-bit

In the 32-weight formats a byte of qs holds weight i (low nibble) and weight i + 16
(high nibble). ``deepinfer_kernels.gguf_reference`` is the executable statement of the
layouts.
"""

from __future__ import annotations

from dataclasses import dataclass


def _refuse(name: str, expected: str, got: object) -> None:
    # validation.fail's message form; not imported from there, since validation imports
    # this table (a cycle otherwise).
    raise ValueError(f"{name}: expected {expected}, got {got}")


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: ``block_weights`` weights stored in ``block_bytes`` bytes."""

    name: str
    type_id: int  # ggml's GGMLQuantizationType value
    block_weights: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights

    def row_bytes(self, k: int, name: str = "k") -> int:
        """Bytes of a row of ``k`` weights; ``ValueError`` naming ``name`` when ``k`` is not
        a positive whole number of blocks (a row, or a tensor-parallel split of one, may
        not cut a block)."""
        if k <= 0 or k % self.block_weights:
            _refuse(name, f"a positive multiple of {self.block_weights} weights (whole "
                    f"{self.name} blocks)", k)
        return k // self.block_weights * self.block_bytes

    def row_weights(self, row_bytes: int, name: str = "row_bytes") -> int:
        """Weights in a row of ``row_bytes`` bytes; ``ValueError`` naming ``name`` when
        that is not a positive whole number of blocks."""
        if row_bytes <= 0 or row_bytes % self.block_bytes:
            _refuse(name, f"a row byte count that is a positive multiple of "
                    f"{self.block_bytes} (whole {self.name} blocks)", f"{row_bytes} bytes")
        return row_bytes // self.block_bytes * self.block_weights


Q4_0 = BlockFormat("Q4_0", 2, 32, 18)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20)
Q5_0 = BlockFormat("Q5_0", 6, 32, 22)
Q5_1 = BlockFormat("Q5_1", 7, 32, 24)
Q8_0 = BlockFormat("Q8_0", 8, 32, 34)
Q4_K = BlockFormat("Q4_K", 12, 256, 144)
Q5_K = BlockFormat("Q5_K", 13, 256, 176)
Q6_K = BlockFormat("Q6_K", 14, 256, 210)

# Keyed by ggml type id, in id order.
BLOCK_FORMATS: dict[int, BlockFormat] = {
    f.type_id: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
}


def block_format(qtype: object, name: str = "qtype") -> BlockFormat:
    """The format of ggml type id ``qtype`` (an int, e.g. a ``GGMLQuantizationType``);
    ``ValueError`` naming ``name`` (the caller's argument) for anything else or a type
    not in the table."""
    fmt = None
    if isinstance(qtype, int) and not isinstance(qtype, bool):
        fmt = BLOCK_FORMATS.get(int(qtype))
    if fmt is None:
        known = ", ".join(f"{f.name}={f.type_id}" for f in BLOCK_FORMATS.values())
        _refuse(name, f"a GGUF block type id ({known})", repr(qtype))
    assert fmt is not None
    return fmt
