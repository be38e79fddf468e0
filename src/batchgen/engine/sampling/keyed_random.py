"""Counter-based random draws keyed by (sequence key, position, token): no generator state anywhere.

A sampled token at output position t of a sample draws its noise from
    bits(v) = mix(mix(sequence_key + t * GOLDEN) + v * GOLDEN),  v = 0 .. V-1,
where `mix` is SplitMix64's finalizer (a bijection of 64-bit integers with full avalanche) and the
sequence key is a 63-bit hash of (seed, request key, sample index) computed once on the host
(`sequence_key`). The draw at a position is a pure function of those four values, so a sample does
not depend on its batch mates, on preemption and recompute, or on speculation (a verify step draws
the noise of positions t .. t+k in one call and gets exactly what k+1 plain decode steps would).

Everything is int64 tensor arithmetic (multiplication wraps modulo 2^64 on every torch device),
vectorized over rows and vocabulary: one set of elementwise kernels per call, whatever the batch.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int, bits: int) -> int:
    """An unsigned constant as the two's-complement integer torch stores in `bits` bits."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


_GOLDEN64 = _signed(0x9E3779B97F4A7C15, 64)
_MIX64_1 = _signed(0xBF58476D1CE4E5B9, 64)
_MIX64_2 = _signed(0x94D049BB133111EB, 64)
_GOLDEN32 = _signed(0x9E3779B9, 32)
_MIX32_1 = _signed(0x7FEB352D, 32)  # "lowbias32" (C. Wellons' hash prospector): full avalanche
_MIX32_2 = _signed(0x846CA68B, 32)
_UNIFORM_BITS = 24  # (bits + 0.5) / 2^24 in (0, 1): exact in float32 for every value but the largest
# The largest, 2^24 - 0.5, needs 25 significant bits and rounds up to 2^24: a uniform of exactly 1 and
# an exponential of 0, which wins the race with any probability (and gives 0 / 0 = NaN, which argmax
# takes, at a token the filters or a grammar removed). It is clamped to the float just below 1.
_MAX_UNIFORM = 1.0 - 2.0 ** -_UNIFORM_BITS


def sequence_key(seed: int, sample_key: str, sample_index: int) -> int:
    """A stable 63-bit key for (seed, sample key, sample index): no batch, order or resume effect."""
    digest = hashlib.sha256(f"{seed}\x00{sample_key}\x00{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _shift_right(x: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Logical right shift (torch's >> is arithmetic on signed ints: mask off the copied sign bits)."""
    return (x >> bits) & ((1 << (width - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer over an int64 tensor (elementwise, wrapping arithmetic)."""
    x = (x ^ _shift_right(x, 30, 64)) * _MIX64_1
    x = (x ^ _shift_right(x, 27, 64)) * _MIX64_2
    return x ^ _shift_right(x, 31, 64)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over an int32 tensor: a bijection of 32-bit words, half the bytes of mix64 per token."""
    x = (x ^ _shift_right(x, 16, 32)) * _MIX32_1
    x = (x ^ _shift_right(x, 15, 32)) * _MIX32_2
    return x ^ _shift_right(x, 16, 32)


def row_states(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(R,) int32: the state of each (sequence key, position), mixed in 64 bits, then its low word."""
    state = mix64(keys + positions * _GOLDEN64)
    return (state & 0xFFFFFFFF).to(torch.int32)  # wraps into int32's range: the same 32 bits


def _uniform_from(state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    bits = _shift_right(mix32(state + token_ids.to(torch.int32) * _GOLDEN32), 32 - _UNIFORM_BITS, 32)
    return uniform_of_bits(bits)


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """Integer draws in [0, 2^24) -> float32 uniforms in (0, 1), both ends excluded."""
    return ((bits.to(torch.float32) + 0.5) * (1.0 / (1 << _UNIFORM_BITS))).clamp_(max=_MAX_UNIFORM)


def keyed_uniform(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, V) float32 uniforms in (0, 1): row r's are those of (keys[r], positions[r]).

    keys, positions: (R,) int64 on the device the draws are wanted on.
    """
    states = row_states(keys, positions)  # (R,)
    token_ids = torch.arange(vocab_size, dtype=torch.int32, device=keys.device)  # (V,)
    return _uniform_from(states[:, None], token_ids[None, :])


def keyed_exponential(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, V) float32 Exp(1) draws: argmax(p / E) over a row is a draw from p (the exponential race)."""
    return -torch.log(keyed_uniform(keys, positions, vocab_size))


def keyed_exponential_at(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(M,) float32: the Exp(1) draws of `keyed_exponential` at chosen entries only (same values).

    keys, positions, token_ids: (M,) int64, one entry each (row's key and position, column).
    A filtered distribution (top-k, top-p, min-p) needs the noise of its support alone.
    """
    return -torch.log(_uniform_from(row_states(keys, positions), token_ids))


def keyed_exponential_rows(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, K) float32: the Exp(1) draws of `keyed_exponential` at each row's own K tokens (same values).

    keys, positions: (R,) int64; token_ids: (R, K) int64 (a row's candidates, e.g. its top-k).
    """
    return -torch.log(_uniform_from(row_states(keys, positions)[:, None], token_ids))
