"""Runs models in vLLM's offline engine (`vllm.LLM`), one after another in one process (tests/engines/test_vllm.py).

    python tests/engines/vllm_worker.py JOBS.json RESULTS.jsonl

JOBS.json: {"max_model_len": N, "jobs": [{"name", "model", "windows": [[ids...]...], "prompts": [[ids...]...],
"max_tokens": N, "engine_args": {more arguments of vllm.LLM}}]}. For each job, one JSON line in RESULTS.jsonl:
{"name", "ok": true, "prompt_logprobs": [[the log-probability of each window token but the first, given the tokens
before it]...], "greedy": [[token ids]...]}, or {"name", "ok": false, "error": "Type: message", "where": "FILE:LINE
(function)" inside vllm/} where vLLM refused or failed the model (the next job still runs).

One process, vLLM imported once (about 25 s on 2 busy cores, where each engine then starts in 2 to 5 s): the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller) and its one worker too
("uni" executor), so an error is vLLM's own exception, not a dead engine process. Each engine runs in eager mode (no
torch.compile: minutes of compiling per model on 2 cores) without prefix caching (windows overlap by a token).
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def run_job(job: dict, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], enforce_eager=True, max_model_len=max_model_len, max_num_seqs=8, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False, **job.get("engine_args", {}))
    try:
        scored = llm.generate([{"prompt_token_ids": ids} for ids in job["windows"]],
                              SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
        logprobs = [[entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
                    for ids, out in zip(job["windows"], scored)]
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
        generated = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
        return {"name": job["name"], "ok": True, "prompt_logprobs": logprobs,
                "greedy": [list(out.outputs[0].token_ids) for out in generated]}
    finally:
        del llm  # the engine goes before the next one starts, an exception's traceback holding this frame or not


def where(exc: BaseException) -> str:
    """The innermost frame inside vLLM that the exception passed: which of its kernels or checks refused."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if "/vllm/" in frame.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename.split('/vllm/', 1)[1]}:{frame.lineno} ({frame.name})"


def main() -> None:
    jobs_path, results_path = sys.argv[1:3]
    spec = json.loads(open(jobs_path).read())
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with open(results_path, "w") as results:
        for job in spec["jobs"]:
            print(f"vllm_worker: {job['name']} ({job['model']})", file=sys.stderr, flush=True)
            try:
                result = run_job(job, spec["max_model_len"])
            except Exception as exc:  # vLLM's refusal or failure is the result: the test decides what it means
                traceback.print_exc()
                result = {"name": job["name"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "where": where(exc)}
            gc.collect()
            cleanup_dist_env_and_memory()
            results.write(json.dumps(result) + "\n")
            results.flush()


if __name__ == "__main__":  # vLLM may start processes by spawning, which re-imports this module
    main()
