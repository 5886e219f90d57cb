"""The main job on the embedded default: generate with async scheduling on.

    python -m vllm_neuron_sched.demo [--sync] [--tp N] [--requests N] [--max-tokens N]

Makes the tiny checkpoint once (random weights, cached under
``~/.cache/vllm_neuron_sched``), runs ``LLM.generate`` through our platform
and prints throughput plus the worker's async/fallback counters.
"""

import argparse
import os
import time
from pathlib import Path

DEFAULT_CHECKPOINT = Path.home() / ".cache" / "vllm_neuron_sched" / "tiny-llama"


def ensure_checkpoint(path: Path = DEFAULT_CHECKPOINT) -> Path:
    from vllm_neuron_sched.testing.checkpoint import make_checkpoint

    if not (path / "config.json").exists():
        make_checkpoint(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", action="store_true", help="--no-async-scheduling")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        cores = os.cpu_count() or 1
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(rank % cores) for rank in range(args.tp)),
        )
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(ensure_checkpoint()),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=args.requests,
        tensor_parallel_size=args.tp,
        async_scheduling=not args.sync,
        seed=0,
    )
    prompts = [f"the request {i} token step batch" for i in range(args.requests)]
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"first completion: {outputs[0].outputs[0].text!r}")
    print(f"{num_tokens} tokens in {elapsed:.2f} s = {num_tokens / elapsed:.0f} tok/s")
    stats = llm.collective_rpc("get_async_scheduling_stats")
    print(f"async scheduling counters (rank 0): {stats[0]}")


if __name__ == "__main__":
    main()
