"""lm-evaluation-harness through the OpenAI server (`make eval-check LM_EVAL=/path/venv/bin/lm_eval`).

Runs three local tasks with lm-eval's `local-completions` model against tritonserver + the OpenAI
server (the default model, float32), and the same tasks with lm-eval's `hf` model (transformers,
in-process, float32) on the same checkpoint, then compares every request's result:
- a multiple-choice task (loglikelihood: echo + logprobs, max_tokens 1, token-array prompts,
  batched), from the first pydoc topics: the true continuation of a passage against three others;
- a perplexity task (loglikelihood_rolling: the same requests over whole documents, each longer
  than the step budget);
- a generation task (generate_until: greedy, up to 24 tokens or a full stop).
Both prepend BOS (the two lm-eval models default differently: `hf` adds it for this tokenizer,
`local-completions` does not). Each loglikelihood must agree within 1e-3 + 1e-6 of its value,
each is_greedy and each generated text exactly; the script prints both harnesses' metrics and
the largest difference, and exits non-zero if anything disagrees.

lm-eval is not a dependency of inflight: install it in a venv of its own
(`python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install "lm-eval[api,hf]==0.4.13"
torch==2.13.0`). Nothing leaves the machine: the tasks' data are written to a temporary directory.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [os.path.join(REPO, "backend_src"), os.path.join(REPO, "client"), REPO]
sys.path[:0] = PATHS

from inflight.serving.launch import ServerProcess, make_repository  # noqa: E402
from inflight_client.openai_server.process import OpenAIServerProcess  # noqa: E402

DEFAULT_MODEL = os.path.join(REPO, "model_repository", "llm", "1", "inflight-tiny")
TOLERANCE = 1e-3        # float32 on both sides: absolute, plus RELATIVE of the value (a sum over many tokens)
RELATIVE = 1e-6
TASKS = ("inflight_pydoc_choice", "inflight_pydoc_perplexity", "inflight_pydoc_continue")

CHOICE_TASK = """task: inflight_pydoc_choice
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

PERPLEXITY_TASK = """task: inflight_pydoc_perplexity
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

GENERATE_TASK = """task: inflight_pydoc_continue
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: str, num_docs: int) -> None:
    """Passages of the first pydoc topics: a 40-word context and four 8-word continuations, the
    true one placed at random; and 500-word documents for perplexity (~750 tokens: longer than
    the step budget, so each prompt is computed in chunks)."""
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    words = " ".join(topics[k] for k in sorted(topics)[:20]).split()
    rng = random.Random(0)
    choices, documents = [], []
    for _ in range(num_docs):
        start = rng.randrange(len(words) - 60)
        others = [" " + " ".join(words[s:s + 8]) for s in (rng.randrange(len(words) - 8) for _ in range(3))]
        truth = " " + " ".join(words[start + 40:start + 48])
        order = [truth, *others]
        rng.shuffle(order)
        choices.append({"context": " ".join(words[start:start + 40]), "choices": order, "label": order.index(truth),
                        "continuation": truth})
        begin = rng.randrange(len(words) - 500)
        documents.append({"text": " ".join(words[begin:begin + 500])})
    for name, rows, template in (("choice", choices, CHOICE_TASK), ("perplexity", documents, PERPLEXITY_TASK),
                                 ("continue", choices, GENERATE_TASK)):
        data = os.path.join(directory, f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            f.write(template.format(data=data))


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks_dir: str, out: str, extra: list[str]) -> None:
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", tasks_dir, "--output_path", out, "--log_samples", *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                         "TOKENIZERS_PARALLELISM": "false"})


def read_results(out: str) -> tuple[dict, dict]:
    """(task -> metrics, (task, doc id) -> [(loglikelihood, is_greedy) per request])."""
    [results_file] = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    with open(results_file) as f:
        metrics = json.load(f)["results"]
    samples = {}
    for task in TASKS:
        [path] = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            for line in f:
                sample = json.loads(line)
                samples[task, sample["doc_id"]] = [resp[0] for resp in sample["resps"]]
    return metrics, samples


def compare(served: dict, reference: dict) -> tuple[float, int, int]:
    """(largest loglikelihood difference, requests that disagree: a loglikelihood beyond the
    tolerance, is_greedy or the generated text; requests compared). The samples files hold values
    as strings: [loglikelihood, is_greedy] per choice, a document's loglikelihood, or a text."""
    assert served.keys() == reference.keys(), "both harness runs must cover the same documents"
    worst, disagreements, count = 0.0, 0, 0

    def differ(ours: str, theirs: str) -> bool:
        nonlocal worst
        gap = abs(float(ours) - float(theirs))
        worst = max(worst, gap)
        return gap > TOLERANCE + RELATIVE * abs(float(theirs))

    for (task, doc), responses in reference.items():
        for ours, theirs in zip(served[task, doc], responses):
            if task == "inflight_pydoc_choice":
                disagreements += differ(ours[0], theirs[0]) or str(ours[1]) != str(theirs[1])
            elif task == "inflight_pydoc_perplexity":
                disagreements += differ(ours, theirs)
            else:
                disagreements += ours != theirs
            count += 1
    return worst, disagreements, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command of a venv with lm-eval[api]")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint directory with a tokenizer")
    parser.add_argument("--docs", type=int, default=40, help="documents per task")
    args = parser.parse_args()
    if not (os.path.isfile(args.lm_eval) and os.access(args.lm_eval, os.X_OK)):
        parser.error(f"--lm-eval {args.lm_eval!r} is not an executable file (a venv's bin/lm_eval)")
    model_dir = os.path.abspath(args.model)
    tmp = tempfile.mkdtemp(prefix="lm-eval-check-")
    tasks_dir = os.path.join(tmp, "tasks")
    os.makedirs(tasks_dir)
    write_tasks(tasks_dir, args.docs)
    context = json.load(open(os.path.join(model_dir, "config.json")))["max_position_embeddings"]
    name = os.path.basename(model_dir)
    repo = make_repository(os.path.join(tmp, "repo"), model_dir, {"dtype": "float32"})
    with ServerProcess(repo, log_path=os.path.join(tmp, "tritonserver.log")) as triton, \
            OpenAIServerProcess(triton.http_url, model_dir, log_path=os.path.join(tmp, "openai.log"),
                                env={"PYTHONPATH": os.pathsep.join(PATHS)}) as api:
        run_lm_eval(args.lm_eval, "local-completions",
                    f"model={name},base_url={api.base_url}/completions,tokenizer={model_dir},"
                    f"tokenized_requests=True,num_concurrent=4,max_retries=1,max_length={context},add_bos_token=True",
                    tasks_dir, os.path.join(tmp, "served"), ["--batch_size", "8"])
    run_lm_eval(args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32,max_length={context},add_bos_token=True",
                tasks_dir, os.path.join(tmp, "hf"), ["--device", "cpu", "--batch_size", "8"])
    served_metrics, served = read_results(os.path.join(tmp, "served"))
    hf_metrics, reference = read_results(os.path.join(tmp, "hf"))
    worst, disagreements, count = compare(served, reference)
    print("\n| task | metric | lm-eval local-completions -> inflight | lm-eval hf (transformers) |\n|---|---|---|---|")
    for task in TASKS:
        for metric, value in hf_metrics[task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                print(f"| {task} | {metric.removesuffix(',none')} | {served_metrics[task][metric]:.6g} | {value:.6g} |")
    verdict = "FAIL" if disagreements else "PASS"
    print(f"\n{count} requests compared: largest loglikelihood difference {worst:.2e} (tolerance {TOLERANCE:g} + "
          f"{RELATIVE:g} x |value|), {disagreements} disagree -> {verdict} (files in {tmp})")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
