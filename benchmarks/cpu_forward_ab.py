"""Decode steps/s and 512-token prefill of the default model, quantized (bf16 KV) vs float32 dense, in one
process, interleaved rounds (issue 18). Usage: python benchmarks/cpu_forward_ab.py [rounds]
"""
import time, torch, sys
sys.path.insert(0,'.')
from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
from novainfer.loader.default_model import default_model_path
from novainfer.loader.model_loader import load_hf_config, load_model
from novainfer.attention import cpu_backend
from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.layers.attention import Attention
path=default_model_path(); cfg=load_hf_config(path)
models={}
for name,q,kv in [("quantized+bf16KV",True,torch.bfloat16),("float32 dense",False,torch.float32)]:
    m=load_model(path,cfg,torch.float32,torch.device('cpu'),quant_config=GGUFCPUConfig() if q else None)
    for l in [x for x in m.modules() if isinstance(x, Attention)]:
        l.k_cache=torch.zeros(64,16,3,64,dtype=kv); l.v_cache=torch.zeros(64,16,3,64,dtype=kv); l.backend=cpu_backend
    models[name]=m
def meta(n,q):
    return AttentionMetadata(query_start_loc=torch.tensor([0,q],dtype=torch.int32),seq_lens=torch.tensor([n],dtype=torch.int32),
       slot_mapping=torch.arange(n-q,n),block_tables=torch.arange(64,dtype=torch.int32)[None],max_query_len=q,max_seq_len=n,
       query_start_loc_cpu=[0,q],seq_lens_cpu=[n])
def step(m,n,q):
    with attention_metadata(meta(n,q)): h=m(torch.randint(0,49152,(q,)),torch.arange(n-q,n))
    return m.compute_logits(h[-1:])
res={k:{"decode":[],"prefill":[]} for k in models}
with torch.inference_mode():
    for r in range(int(sys.argv[1]) if len(sys.argv)>1 else 3):
        for k,m in models.items():
            step(m,130,1)
            t=time.perf_counter()
            for _ in range(10): step(m,130,1)
            res[k]["decode"].append(10/(time.perf_counter()-t))
            t=time.perf_counter(); step(m,512,512); res[k]["prefill"].append((time.perf_counter()-t)*1e3)
for k,v in res.items(): print(k, "decode steps/s", [round(x,1) for x in v["decode"]], "prefill512 ms", [round(x) for x in v["prefill"]])
