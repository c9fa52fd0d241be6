"""Compare xgrammar and llguidance on the default model's tokenizer: grammar compile time for a JSON schema and
per-token bitmask time (docs/ARCHITECTURE.md records the run). Run: flock /tmp/novainfer-bench.lock python -m benchmarks.grammar_backends"""
import time, json, sys
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from novainfer.loader.default_model import default_model_path
from novainfer.loader.model_loader import load_tokenizer
tok = load_tokenizer(default_model_path())
print(type(tok), len(tok))
SCHEMA = {"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
  "color": {"enum": ["red", "green", "blue"]}, "active": {"type": "boolean"},
  "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
  "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}, "required": ["city", "zip"], "additionalProperties": False}},
  "required": ["name", "age", "color", "active", "tags", "address"], "additionalProperties": False}
V = len(tok)
ans = json.dumps({"name": "Ann", "age": 33, "color": "red", "active": True, "tags": ["a", "bb"], "address": {"city": "Paris", "zip": 75001}})
ids = tok.encode(ans, add_special_tokens=False)
# xgrammar
import xgrammar as xgr
t=time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); ti=time.perf_counter()-t
comp = xgr.GrammarCompiler(info, max_threads=1)
t=time.perf_counter(); cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False); tc=time.perf_counter()-t
m = xgr.GrammarMatcher(cg)
bm = xgr.allocate_token_bitmask(1, info.vocab_size)
ts=[]
for i in ids:
    t=time.perf_counter(); m.fill_next_token_bitmask(bm); ts.append(time.perf_counter()-t)
    assert m.accept_token(i), i
print(f"xgrammar tokinfo {ti*1e3:.0f}ms compile {tc*1e3:.1f}ms mask mean {sum(ts)/len(ts)*1e6:.0f}us max {max(ts)*1e6:.0f}us over {len(ts)} tokens")
# llguidance
import llguidance, llguidance.hf
t=time.perf_counter(); lt = llguidance.hf.from_tokenizer(tok, n_vocab=V); ti=time.perf_counter()-t
grm = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
t=time.perf_counter(); lm = llguidance.LLMatcher(lt, grm); tc=time.perf_counter()-t
t=time.perf_counter(); lm2 = llguidance.LLMatcher(lt, grm); tc2=time.perf_counter()-t
print("err", lm.get_error())
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
bm2 = allocate_token_bitmask(1, V)
ts=[]
for i in ids:
    t=time.perf_counter(); fill_next_token_bitmask(lm, bm2, 0); ts.append(time.perf_counter()-t)
    assert lm.consume_token(i), i
print(f"llguidance tokinfo {ti*1e3:.0f}ms compile {tc*1e3:.1f}ms (again {tc2*1e3:.1f}ms) mask mean {sum(ts)/len(ts)*1e6:.0f}us max {max(ts)*1e6:.0f}us over {len(ts)} tokens")
