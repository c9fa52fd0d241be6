"""A Gated DeltaNet decoder layer's CPU decode step in one C call (csrc/gdn_layer_cpu.c): the descriptor it reads,
filled once from a layers/linear_attention.GatedDeltaNet whose projections are packed (quantized GGUF) weights (and,
for the whole layer, its models/qwen3_5.HybridDecoderLayer's norms and dense MLP, which
models/qwen3_5_cpu_decode.py checks), and the calls. The layer-by-layer
path takes ~40 Python-level calls for the same work (the norms, four input projections, the gates in seven torch
ops, the conv and rule, the gated norm, out_proj, the MLP)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import nn

from novainfer.kernels.cpu import library
from novainfer.kernels.cpu.decoder_stack import _ERRORS, QLinearDesc, packed_weight, qlinear_desc

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class GDNLayerDesc(ctypes.Structure):
    """gdn_layer of gdn_layer_cpu.c, field for field."""

    _fields_ = [
        ("in_qkv", QLinearDesc),
        ("in_z", QLinearDesc),
        ("in_b", QLinearDesc),
        ("in_a", QLinearDesc),
        ("out", QLinearDesc),
        ("b_dense", _P),
        ("a_dense", _P),
        ("input_norm", _P),
        ("post_norm", _P),
        ("input_eps", _F),
        ("post_eps", _F),
        ("gate_up", QLinearDesc),
        ("down", QLinearDesc),
        ("conv_w", _P),
        ("neg_a", _P),
        ("dt_bias", _P),
        ("norm_w", _P),
        ("eps", _F),
        ("conv_state", _P),
        ("ssm_state", _P),
        ("C", _I),
        ("K", _I),
        ("nk", _I),
        ("nv", _I),
        ("dk", _I),
        ("dv", _I),
    ]


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = library._library()
    if lib is None or not hasattr(lib, "gdn_layer_decode"):
        return None
    lib.gdn_layer_workspace.argtypes = [ctypes.POINTER(GDNLayerDesc), _I]
    lib.gdn_layer_workspace.restype = ctypes.c_size_t
    lib.gdn_mixer_decode.argtypes = [ctypes.POINTER(GDNLayerDesc), _P, _I, _P, _P, _P, _P, _I]
    lib.gdn_mixer_decode.restype = _I
    lib.gdn_layer_decode.argtypes = [ctypes.POINTER(GDNLayerDesc), _P, _P, _P, _P, _I, _P, _P, _P, _I]
    lib.gdn_layer_decode.restype = _I
    return lib


def _projections(layer: nn.Module) -> list[nn.Module]:
    return [layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj]


def supports(layer: nn.Module) -> bool:
    """Whether the C step computes this layer: every projection packed (in_proj_b / in_proj_a may be dense float32:
    llama.cpp's files keep those small tensors unquantized) on one rank without a bias, float32 state pools and
    parameters, the kernels built."""
    if _lib() is None or layer.tp_size != 1:
        return False
    for i, lin in enumerate(_projections(layer)):
        dense_ok = i in (2, 3) and lin.weight.dtype is torch.float32 and lin.weight.dim() == 2
        if lin.bias is not None or (packed_weight(lin) is None and not dense_ok):
            return False
    params = (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight, layer.conv_state, layer.ssm_state)
    pools = (layer.conv_state, layer.ssm_state)
    return all(t.dtype is torch.float32 and not t.is_cuda for t in params) and all(
        t.numel() and t.is_contiguous() for t in pools
    )


class GDNLayerKernel:
    """One layer's filled descriptor (with the tensors it points into) and its workspace. With a decoder, its norms
    and MLP are filled too (run_layer); without, only the mixer (run)."""

    def __init__(self, layer: nn.Module, decoder: nn.Module | None = None):
        self.kept = [
            layer.conv1d.weight.reshape(layer.conv_dim, -1).contiguous(),
            -layer.A_log.exp(),
            layer.dt_bias.contiguous(),
            layer.norm.weight.contiguous(),
        ]
        conv_w, neg_a, dt_bias, norm_w = self.kept
        dense = []
        for lin in (layer.in_proj_b, layer.in_proj_a):
            dense.append(None if packed_weight(lin) is not None else lin.weight.contiguous())
        self.kept += [t for t in dense if t is not None]
        if decoder is not None:
            norms = [1.0 + n.weight for n in (decoder.input_layernorm, decoder.post_attention_layernorm)]
            self.kept += norms
            mlp = decoder.mlp
            whole = [norms[0].data_ptr(), norms[1].data_ptr(), decoder.input_layernorm.eps]
            whole += [decoder.post_attention_layernorm.eps, qlinear_desc(packed_weight(mlp.gate_up_proj), None)]
            whole += [qlinear_desc(packed_weight(mlp.down_proj), None)]
        else:
            whole = [0, 0, 0.0, 0.0, QLinearDesc(), QLinearDesc()]
        self.desc = GDNLayerDesc(
            *[
                QLinearDesc() if packed_weight(lin) is None else qlinear_desc(packed_weight(lin), None)
                for lin in _projections(layer)
            ],
            *[0 if t is None else t.data_ptr() for t in dense],
            *whole,
            conv_w.data_ptr(),
            neg_a.data_ptr(),
            dt_bias.data_ptr(),
            norm_w.data_ptr(),
            layer.norm.eps,
            layer.conv_state.data_ptr(),
            layer.ssm_state.data_ptr(),
            layer.conv_dim,
            layer.kernel,
            layer.num_k_heads,
            layer.num_v_heads,
            layer.head_k_dim,
            layer.head_v_dim,
        )
        self.workspace = torch.empty(0)

    def _operands(self, m: int, slots: torch.Tensor, continues: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = _lib().gdn_layer_workspace(ctypes.byref(self.desc), m)
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need)
        return slots.to(torch.int64).contiguous(), continues.to(torch.uint8).contiguous()

    def run(self, x: torch.Tensor, slots: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
        """out_proj(gated_norm(rule(conv(in_proj(x))))) [M, H] for one decode row per sequence; x [M, H] float32."""
        m = x.shape[0]
        slots64, cont = self._operands(m, slots, continues)
        x = x.contiguous()
        out = torch.empty(m, self.desc.out.N)
        _check(
            _lib().gdn_mixer_decode(
                ctypes.byref(self.desc),
                x.data_ptr(),
                m,
                slots64.data_ptr(),
                cont.data_ptr(),
                out.data_ptr(),
                self.workspace.data_ptr(),
                library.num_threads(),
            )
        )
        return out

    def run_layer(
        self, h: torch.Tensor, residual: torch.Tensor | None, slots: torch.Tensor, continues: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer as HybridDecoderLayer.forward returns it: (the MLP's output, the new residual)."""
        m = h.shape[0]
        slots64, cont = self._operands(m, slots, continues)
        h = h.contiguous()
        residual = None if residual is None else residual.contiguous()
        out, res_out = torch.empty_like(h), torch.empty_like(h)
        _check(
            _lib().gdn_layer_decode(
                ctypes.byref(self.desc),
                h.data_ptr(),
                None if residual is None else residual.data_ptr(),
                res_out.data_ptr(),
                out.data_ptr(),
                m,
                slots64.data_ptr(),
                cont.data_ptr(),
                self.workspace.data_ptr(),
                library.num_threads(),
            )
        )
        return out, res_out


def _check(rc: int) -> None:
    if rc:
        cls, msg = _ERRORS.get(rc, (RuntimeError, f"gated deltanet layer: error {rc}"))
        raise cls(msg)


def layer_kernel(layer: nn.Module, decoder: nn.Module | None = None) -> GDNLayerKernel | None:
    """The mixer's kernel, filled for the whole decoder layer where decoder is given (the caller checked that the C
    call computes that layer's norms and MLP), or None where the C step does not apply to the mixer; decided and
    built once, again when the runner binds other state pools."""
    whole = decoder is not None
    ptrs = (layer.conv_state.data_ptr(), layer.ssm_state.data_ptr())
    cached = layer.__dict__.setdefault("_c_decode", {}).get(whole)
    if cached is not None and cached[0] == ptrs:
        return cached[1]
    kernel = GDNLayerKernel(layer, decoder) if supports(layer) else None
    layer.__dict__["_c_decode"][whole] = (ptrs, kernel)
    return kernel
