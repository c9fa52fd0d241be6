"""The Gated DeltaNet layer (layers/linear_attention.py; its kernels are tested against transformers in
test_gated_delta_kernels.py and test_gated_delta_cpu.py): its forward split into chunks and decodes against one
pass over the whole sequence, checkpoints saved and restored inside a chunk; the layer's Triton path (the kernels
interpreted on the CPU) against its CPU path, step by step on the same slots."""

from __future__ import annotations

import torch

from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.layers.linear_attention import GatedDeltaNet, StateSlotsMetadata


class TinyConfig:
    hidden_size, rms_norm_eps, hidden_act = 32, 1e-6, "silu"
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim = 2, 4, 8, 6
    linear_conv_kernel_dim = 4


def step_metadata(
    layer: GatedDeltaNet,
    lens: list[int],
    seq_lens: list[int],
    slots: list[int] | None,
    restores: dict[int, int] | None = None,
    saves: dict[int, tuple[int, int]] | None = None,
) -> AttentionMetadata:
    """A step's metadata, the fresh sequences' slots zeroed first as the runner does."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    fresh = [i for i in range(len(lens)) if seq_lens[i] == lens[i]]
    state = (
        None if slots is None else StateSlotsMetadata(torch.tensor(slots), slots, restores or {}, saves or {}, fresh)
    )
    if state is not None:
        state.zero_fresh(layer.conv_state, layer.ssm_state)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        slot_mapping=torch.zeros(0),
        block_tables=torch.zeros(0),
        max_query_len=max(lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        state_slots=state,
    )


def run(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    lens: list[int],
    seq_lens: list[int],
    slots: list[int] | None,
    restores: dict[int, int] | None = None,
    saves: dict[int, tuple[int, int]] | None = None,
):
    """The layer's forward on hidden states x."""
    with attention_metadata(step_metadata(layer, lens, seq_lens, slots, restores, saves)), torch.no_grad():
        return layer(x)


def test_layer_chunks_and_decodes_equal_one_pass():
    torch.manual_seed(0)
    layer = GatedDeltaNet(TinyConfig())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.conv_state = torch.full((3, 3, layer.conv_dim), 7.0)  # stale contents: a fresh start zeroes them
    layer.ssm_state = torch.full((3, 4, 8, 6), 7.0)
    x = torch.randn(11, 32)
    whole = run(layer, x, [11], [11], None)
    # slot 2: a 2-token chunk, a 6-token chunk batched with another sequence's fresh prefill, then 3 decodes
    parts = [run(layer, x[:2], [2], [2], [2])]
    mixed = run(layer, torch.cat([x[2:8], x[:5]]), [6, 5], [8, 5], [2, 0])
    parts.append(mixed[:6])
    torch.testing.assert_close(mixed[6:], whole[:5], atol=1e-5, rtol=1e-4)
    for t in range(8, 11):
        parts.append(run(layer, torch.stack([x[t], x[t - 3]]), [1, 1], [t + 1, t - 2], [2, 0])[:1])
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-4)
    # a one-token prompt in a one-token-per-sequence step starts from zeros, not from its slot's stale state
    layer.conv_state[1], layer.ssm_state[1] = 7.0, 7.0
    first = run(layer, torch.stack([x[0], x[11 - 3]]), [1, 1], [1, 9], [1, 0])[:1]
    torch.testing.assert_close(first, whole[:1], atol=1e-5, rtol=1e-4)


def test_checkpoint_saved_inside_a_chunk_restores_there():
    """A save 5 tokens into a 9-token prefill, restored into another slot in the same step (after the saver) and
    in a later one-token step, continues exactly as the one pass over the sequence does."""
    torch.manual_seed(1)
    layer = GatedDeltaNet(TinyConfig())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.conv_state = torch.zeros(4, 3, layer.conv_dim)
    layer.ssm_state = torch.zeros(4, 4, 8, 6)
    x = torch.randn(9, 32)
    whole = run(layer, x, [9], [9], None)
    # slot 0 prefills 9 tokens saving at 5 into checkpoint slot 3; slot 1 resumes at 5 from it in the same step
    out = run(layer, torch.cat([x, x[5:9]]), [9, 4], [9, 9], [0, 1], restores={1: 3}, saves={0: (5, 3)})
    torch.testing.assert_close(out[:9], whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[9:], whole[5:], atol=1e-5, rtol=1e-4)
    one = run(layer, x[5:6], [1], [6], [2], restores={0: 3})  # a one-token step that restores
    torch.testing.assert_close(one, whole[5:6], atol=1e-5, rtol=1e-4)


def tiny_layer(seed: int, slots: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(TinyConfig())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer.conv_state = torch.zeros(slots, *layer.state_shapes()[0])
    layer.ssm_state = torch.zeros(slots, *layer.state_shapes()[1])
    return layer


def mix(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    lens: list[int],
    seq_lens: list[int],
    slots: list[int] | None,
    use_triton: bool,
    restores: dict[int, int] | None = None,
    saves: dict[int, tuple[int, int]] | None = None,
):
    """The layer's conv + delta rule on x's projections."""
    meta = step_metadata(layer, lens, seq_lens, slots, restores, saves)
    return layer.mix(*project(layer, x), meta, use_triton=use_triton).float()


def project(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's conv input, decay g and beta for hidden states x (as its forward computes them)."""
    with torch.no_grad():
        beta = torch.sigmoid(layer.in_proj_b(x).float())
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(layer.in_proj_a(x).float() + layer.dt_bias)
        return layer.in_proj_qkv(x), g, beta


def test_triton_path_matches_torch_path():
    """Prefill chunks, a mixed step, a save inside a chunk restored in the same step, a one-token restore and
    decodes of a fresh one-token prompt beside a continuing sequence: the kernels (the slots updated in place)
    give the torch path's outputs and leave the same states."""
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(3))
    steps = [  # (tokens, lens, seq_lens, slots, restores, saves)
        (x[:9], [9], [9], None, None, None),  # a profiling forward: no slots
        (torch.cat([x[:7], x[5:7]]), [7, 2], [7, 7], [0, 1], {1: 4}, {0: (5, 4)}),  # resumes where seq 0 saves
        (torch.cat([x[7:9], x[5:9]]), [2, 4], [9, 9], [0, 2], {1: 4}, {0: (1, 5)}),
        (torch.stack([x[9], x[0], x[7]]), [1, 1, 1], [10, 1, 8], [0, 3, 1], None, None),
        (torch.stack([x[10], x[1]]), [1, 1], [11, 2], [0, 3], None, None),
        (x[8:9], [1], [9], [1], {0: 5}, None),  # a one-token step that restores
    ]
    torch_layer, triton_layer = tiny_layer(5, 6), tiny_layer(5, 6)
    for tokens, lens, seq_lens, slots, restores, saves in steps:
        ref = mix(torch_layer, tokens, lens, seq_lens, slots, False, restores, saves)
        out = mix(triton_layer, tokens, lens, seq_lens, slots, True, restores, saves)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(triton_layer.conv_state, torch_layer.conv_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(triton_layer.ssm_state, torch_layer.ssm_state, atol=1e-4, rtol=1e-4)


def test_prefill_index_built_once_a_step(monkeypatch):
    """Two DeltaNet layers on one step's metadata (a save splits sequence 0 into two waves): the kernels' token
    and chunk index is built once per wave, not per layer, and both layers still give the torch path's outputs."""
    import novainfer.layers.linear_attention as la

    built = []
    real = la.packed_index
    monkeypatch.setattr(la, "packed_index", lambda cu, tokens: built.append(tokens) or real(cu, tokens))
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    lens, seq_lens, slots, saves = [7, 4], [7, 4], [0, 1], {0: (5, 2)}
    ref_layers = [tiny_layer(9 + i, 3) for i in range(2)]
    ours = [tiny_layer(9 + i, 3) for i in range(2)]
    meta = step_metadata(ours[0], lens, seq_lens, slots, None, saves)
    ref_meta = step_metadata(ref_layers[0], lens, seq_lens, slots, None, saves)
    for ref_layer, layer in zip(ref_layers, ours):
        out = layer.mix(*project(layer, x), meta, use_triton=True).float()
        ref = ref_layer.mix(*project(ref_layer, x), ref_meta, use_triton=False).float()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.ssm_state, ref_layer.ssm_state, atol=1e-4, rtol=1e-4)
    assert built == [9, 2]  # wave 1: sequence 0's first 5 tokens and sequence 1; wave 2: sequence 0's last 2


def test_graph_decode_inputs_pad_state_slots():
    """A decode graph's static inputs carry the slots; the rows padded up to the captured batch size get slot -1,
    which the kernels neither read nor write: the real rows and every slot equal the torch path's."""
    from novainfer.worker.cuda_graph import DecodeGraphs

    torch_layer, triton_layer = tiny_layer(7, 4), tiny_layer(7, 4)
    prefill = torch.randn(6, 32, generator=torch.Generator().manual_seed(8))
    for layer, use_triton in ((torch_layer, False), (triton_layer, True)):
        mix(layer, prefill, [2, 3, 1], [2, 3, 1], [2, 0, 3], use_triton)
    graphs = DecodeGraphs(triton_layer, 4, 2, 32, torch.float32, torch.device("cpu"), lambda bs: 1, state_slots=True)
    n = 3
    zeros = torch.zeros(n, dtype=torch.long)
    graphs.load_inputs(
        zeros,
        zeros,
        zeros,
        torch.tensor([3, 4, 2], dtype=torch.int32),
        torch.zeros(n, 2, dtype=torch.int32),
        torch.tensor([2, 0, 3]),
    )
    meta = graphs.metadata(4)
    assert meta.state_slots.slots.tolist() == [2, 0, 3, -1] and meta.max_query_len == 1
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    ref = mix(torch_layer, x[:n], [1] * n, [3, 4, 2], [2, 0, 3], False)
    out = triton_layer.mix(*project(triton_layer, x), meta, use_triton=True).float()
    torch.testing.assert_close(out[:n], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(triton_layer.conv_state, torch_layer.conv_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(triton_layer.ssm_state, torch_layer.ssm_state, atol=1e-4, rtol=1e-4)


def test_state_cache_zeroes_only_fresh_slots():
    """A step's sequences that start at position 0 get their slots zeroed in every layer before the forward (the
    kernels read a slot as the initial state); a continuing sequence's and a checkpoint's state stay."""
    from types import SimpleNamespace

    from novainfer.worker.state_cache import StateCache

    layers = [tiny_layer(0, 1), tiny_layer(1, 1)]
    cache = StateCache(layers, torch.float32, torch.device("cpu"), num_slots=3, num_checkpoints=1)
    cache.allocate()
    cache.conv.fill_(7.0)
    cache.ssm.fill_(7.0)

    def scheduled(slot: int, start: int):
        seq = SimpleNamespace(state_slot=slot, state_restore=None, state_save=None)
        return SimpleNamespace(seq=seq, start=start, num_new_tokens=4)

    meta = StateCache.step_metadata([scheduled(2, 0), scheduled(0, 5), scheduled(1, 0)])
    assert meta.slots_cpu == [2, 0, 1] and meta.fresh == [0, 2]
    cache.zero_fresh(meta)
    for layer in layers:
        for pool in (layer.conv_state, layer.ssm_state):
            assert pool[[1, 2]].abs().sum() == 0 and (pool[[0, 3]] == 7.0).all()
