"""What the serve memory cuts rely on: the lean GGUF reader reads what gguf-py's GGUFReader reads (metadata,
tensor table, tensor data) and names the file when it is cut short; a loaded model keeps no mapping of its
GGUF file; the layers of a model share one rotary table; trimming the C heap gives freed pages back."""

import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from novainfer.loader.gguf_file import GGUFFile

RNG = np.random.default_rng(1)


def write_gguf(path) -> None:
    """Every metadata value kind the loader meets, and tensors of float and block types."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_string("general.name", "tiny ünïcode")
    w.add_bool("tiny.flag", True)
    w.add_int32("tiny.neg", -7)
    w.add_uint64("tiny.big", 1 << 40)
    w.add_float64("tiny.f64", 0.125)
    w.add_token_list(["<s>", "a", "bc", "déf", ""])
    w.add_token_types([1, 1, 1, 2, 3])
    w.add_token_scores([0.0, -1.5, -2.25, 3.0, 1e-3])
    w.add_array("tiny.nested", [[1, 2], [3]])
    w.add_tensor("f32.weight", RNG.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.weight", RNG.standard_normal((2, 64)).astype(np.float16))
    for name, qtype in (("q41.weight", T.Q4_1), ("q80.weight", T.Q8_0)):
        w.add_tensor(name, quantize(RNG.standard_normal((6, 64)).astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_lean_reader_reads_what_gguf_py_reads(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    ref, ours = GGUFReader(str(path)), GGUFFile(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    # gguf-py flattens an array of arrays; the lean reader keeps the nesting the writer wrote
    assert expected.pop("tiny.nested") == [1, 2, 3] and ours.field("tiny.nested") == [[1, 2], [3]]
    assert {k: v for k, v in ours.metadata.items() if k != "tiny.nested"} == expected
    assert ours.field("tokenizer.ggml.tokens") == ["<s>", "a", "bc", "déf", ""]
    assert ours.field("missing", 42) == 42
    file_map = ours.open_map()
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ref.tensors, ours.tensors):
        assert b.shape == tuple(int(d) for d in a.shape) and b.tensor_type == a.tensor_type
        data = ours.tensor_data(file_map, b)
        assert data.dtype == a.data.dtype and data.shape == a.data.shape and np.array_equal(data, a.data)


def test_lean_reader_names_the_file_and_tensor_when_cut(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_gguf(path)
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:-100])
    with pytest.raises(ValueError, match=r"cut\.gguf is corrupt or truncated: tensor q80\.weight holds"):
        GGUFFile(str(cut))
    head = tmp_path / "head.gguf"
    head.write_bytes(raw[:200])  # inside the metadata
    with pytest.raises(ValueError, match=r"head\.gguf is corrupt or truncated"):
        GGUFFile(str(head))
    with pytest.raises(ValueError, match=r"not\.gguf is corrupt or truncated: no GGUF magic"):
        (tmp_path / "not.gguf").write_bytes(b"GGML" + raw[4:])
        GGUFFile(str(tmp_path / "not.gguf"))


def test_loaded_model_keeps_no_mapping_of_its_gguf_and_shares_one_rotary_table(tmp_path):
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.gguf_loader import load_gguf_config
    from novainfer.loader.model_loader import load_model
    from tests.test_quantized_cpu import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {"blk.0.ffn_down": T.Q4_1})
    hf_config = load_gguf_config(str(path))
    hf_config.num_hidden_layers = 1
    net = load_model(str(path), hf_config, torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    ropes = [m for m in net.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert ropes
    # a second model with the same rope reads the same table, not a copy
    net2 = load_model(str(path), hf_config, torch.float32, torch.device("cpu"))
    ropes2 = [m for m in net2.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert ropes2[0].cos_cache.data_ptr() == ropes[0].cos_cache.data_ptr()
    assert ropes2[0].sin_cache.data_ptr() == ropes[0].sin_cache.data_ptr()


_TRIM_CHECK = """
import os, sys, torch
from novainfer.engine.malloc_heap import trim_malloc_heap


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


if not trim_malloc_heap():
    sys.exit(77)  # the C library has no malloc_trim
chunks = [torch.ones(16 << 10) for _ in range(2048)]  # 64 KB each: below the mmap threshold, in the heap
# pins of the same size until one lies above every chunk, so the freed chunks are not the heap's top (which free()
# alone would give back); holes the interpreter's start-up left below the chunks take the first ones
top, pins = max(c.data_ptr() for c in chunks), []
while not pins or pins[-1].data_ptr() < top:
    assert len(pins) < 4096, "no 64 KB allocation landed above the chunks"
    pins.append(torch.ones(16 << 10))
before = rss_mb()
del chunks
freed = rss_mb()
assert trim_malloc_heap()
after = rss_mb()
assert before - freed < 32, (before, freed)  # free() alone keeps the pages resident
assert freed - after > 64, (freed, after)  # 128 MB were freed; the trim gives (most of) them back
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc")
def test_trim_returns_freed_heap_pages_to_the_system():
    # In a fresh interpreter: the heap of a process that ran other tests (pytest-xdist workers run whole files in
    # turn) can hold more freed space below the chunks than any bounded number of pins fills
    import subprocess

    run = subprocess.run([sys.executable, "-c", _TRIM_CHECK], capture_output=True, text=True, timeout=120)
    if run.returncode == 77:
        pytest.skip("the C library has no malloc_trim")
    assert run.returncode == 0, run.stderr[-2000:]
