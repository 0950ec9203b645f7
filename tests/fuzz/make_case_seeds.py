#!/usr/bin/env python3
"""Writes the case-file seeds of the safetensors fuzz corpus (tests/fuzz/corpus/safetensors):
small valid files of each contract and mode, so that the fuzzer starts from inputs that reach the
forwards. Deterministic (a fixed generator), standard library only.

    python3 tests/fuzz/make_case_seeds.py tests/fuzz/corpus/safetensors
"""
import json
import random
import struct
import sys
from pathlib import Path

rng = random.Random(20261205)


def bf16(values):
    out = bytearray()
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest even
        out += struct.pack("<H", (bits >> 16) & 0xFFFF)
    return bytes(out)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def i32(values):
    return struct.pack("<%di" % len(values), *values)


def i64(values):
    return struct.pack("<%dq" % len(values), *values)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def rand(shape, scale=1.0):
    return [rng.uniform(-scale, scale) for _ in range(numel(shape))]


def write(path, tensors, metadata):
    """tensors: name -> (dtype, shape, bytes)."""
    header = {"__metadata__": metadata}
    blob = bytearray()
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(blob))


def kda_inputs(B, T, H, K, V):
    return {
        "q": ("BF16", [B, T, H, K], bf16(rand([B, T, H, K]))),
        "k": ("BF16", [B, T, H, K], bf16(rand([B, T, H, K]))),
        "v": ("BF16", [B, T, H, V], bf16(rand([B, T, H, V]))),
        "g": ("BF16", [B, T, H, K], bf16(rand([B, T, H, K], 2.0))),
        "beta": ("BF16", [B, T, H], bf16(rand([B, T, H], 2.0))),
        "A_log": ("F32", [H], f32(rand([H]))),
        "dt_bias": ("F32", [H, K], f32(rand([H, K]))),
    }


def layer_inputs(T, E, H, D, W, full_rank_gate=False):
    C = H * D
    t = {"hidden_states": ("BF16", [T, E], bf16(rand([T, E])))}
    for name in ("q_proj", "k_proj", "v_proj"):
        t[name + ".weight"] = ("BF16", [C, E], bf16(rand([C, E], 0.3)))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        t[name + ".weight"] = ("F32", [C, 1, W], f32(rand([C, 1, W], 0.5)))
    t["f_a_proj.weight"] = ("BF16", [D, E], bf16(rand([D, E], 0.3)))
    t["f_b_proj.weight"] = ("BF16", [C, D], bf16(rand([C, D], 0.3)))
    t["b_proj.weight"] = ("BF16", [H, E], bf16(rand([H, E], 0.3)))
    if full_rank_gate:
        t["g_proj.weight"] = ("BF16", [C, E], bf16(rand([C, E], 0.3)))
    else:
        t["g_a_proj.weight"] = ("BF16", [D, E], bf16(rand([D, E], 0.3)))
        t["g_b_proj.weight"] = ("BF16", [C, D], bf16(rand([C, D], 0.3)))
    t["A_log"] = ("F32", [1, 1, H, 1], f32(rand([H])))
    t["dt_bias"] = ("F32", [C], f32(rand([C])))
    t["o_norm.weight"] = ("BF16", [D], bf16([1.0 + x for x in rand([D], 0.1)]))
    t["o_proj.weight"] = ("BF16", [E, C], bf16(rand([E, C], 0.3)))
    return t


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    bounded = {"gate": "lower_bound", "lower_bound": "-5"}

    # The KDA core: a decode step of 2 rows x 3 tokens from a bf16 state.
    t = kda_inputs(2, 3, 2, 8, 8)
    t["initial_state"] = ("BF16", [2, 2, 8, 8], bf16(rand([2, 2, 8, 8], 0.1)))
    write(out / "case_decode.safetensors", t, dict(bounded, mode="decode"))

    # The KDA core: two sequences (5 and 32 tokens) with two checkpoint requests each.
    t = kda_inputs(1, 37, 1, 8, 8)
    t["cu_seqlens"] = ("I32", [3], i32([0, 5, 37]))
    t["checkpoint_offsets"] = ("I64", [2, 2], i64([-1, 5, 16, 32]))
    write(out / "case_checkpoints.safetensors", t,
          {"gate": "softplus", "final_state": "bf16"})

    # The whole layer: two sequences from given states, with checkpoints.
    T, E, H, D, W = 7, 16, 2, 8, 4
    C = H * D
    t = layer_inputs(T, E, H, D, W)
    t["cu_seqlens"] = ("I64", [3], i64([0, 3, 7]))
    for name in ("conv_state_q", "conv_state_k", "conv_state_v"):
        t[name] = ("BF16", [2, C, W - 1], bf16(rand([2, C, W - 1])))
    t["recurrent_state"] = ("F32", [2, H, D, D], f32(rand([2, H, D, D], 0.1)))
    t["checkpoint_offsets"] = ("I32", [2, 2], i32([3, -1, 0, 4]))
    write(out / "layer_case.safetensors", t, dict(bounded, norm_eps="1e-6"))

    # The whole layer: a verify step of 3 rows x 2 tokens, bf16 state, softplus gate.
    t = layer_inputs(6, E, H, D, W)
    t["recurrent_state"] = ("BF16", [3, H, D, D], bf16(rand([3, H, D, D], 0.1)))
    write(out / "layer_case_decode.safetensors", t,
          {"gate": "softplus", "mode": "decode", "tokens": "2"})

    # The whole layer with the full-rank output gate (g_proj), one sequence, no final states.
    t = layer_inputs(5, E, 1, D, 2, full_rank_gate=True)
    write(out / "layer_case_full_rank.safetensors", t, dict(bounded, final_state="none"))


if __name__ == "__main__":
    main()
