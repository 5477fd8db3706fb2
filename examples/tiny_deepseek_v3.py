"""Write a tiny, randomly initialised DeepSeek-V3 model directory that FCA can audit:

    python examples/tiny_deepseek_v3.py --corpus data/kjv.txt --out cache/dsv3/model

transformers' `DeepseekV3ForCausalLM` with a small config (3 layers, the first dense, then two MoE layers
of 8 routed experts in 4 groups, top-2 from the best 2 groups, one shared expert), random router
correction biases (zero at initialisation, so that they take part in the choice), saved with
`save_pretrained`, and a byte-level BPE tokenizer trained on the corpus's training split beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # a fresh clone runs without installing the package
    sys.path.insert(0, str(REPO))

from fca.tables import data  # noqa: E402

VOCAB_SIZE = 300


def tiny_config() -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,  # layer 0 dense; layers 1 and 2 are MoE blocks with a router each
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
    )


def write_tiny_deepseek_v3(out: str | Path, corpus: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(out)
    documents = data.split_documents(data.load_documents(corpus), 0)["train"]
    data.train_tokenizer(documents, VOCAB_SIZE).save(str(out / "tokenizer.json"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="text file (its training split trains the tokenizer)")
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_tiny_deepseek_v3(args.out, args.corpus, args.seed)}")
