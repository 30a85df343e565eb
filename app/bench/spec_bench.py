"""Speculative decoding against its target alone: ``python -m app.bench spec``.

One target (the GPTQ build of the embedded model, as the default app serves it) in one engine, served under
three names: alone, with n-gram drafts, and with the embedded model drafting on a model server of its own
(``drafter: model``; the calls go to that server's engine as they would to its replica). Per drafter,
workload and concurrency (1 and 8 streams), greedy (so every drafter emits exactly the target's tokens: the
runs do the same work, each answer ending at EOS or ``max_tokens``), or with ``--temperature`` sampled (each
answer then runs to ``max_tokens``, EOS ignored, so that the runs still do the same work):

- output tok/s and the speed-up over the target alone in the same sitting;
- acceptance rate a (accepted / drafted tokens), mean accepted length (1 + accepted / drafts), target
  forward passes per emitted token (the target's steps over its tokens: 1.0 without speculation);
- the draft/target cost ratio c: the draft's measured seconds per drafted token (a draft model: its own
  single-stream decode, measured alone; n-gram: ~0) over the target's per-token step at that concurrency;
- the Leviathan et al. prediction from a and c for the steps that drafted (E(a, k) tokens for 1 + k c of a
  target step, k the mean draft length), the other steps as plain decodes (``steps drafting`` = their share),
  and the measured speed-up over it (where speculation ran);
- the cost v of the run's steps against the target's plain steps (its mean step time over the target alone's:
  verification, drafting and waiting for drafts; Leviathan et al. take a verifying step to cost 1 + k c, true
  of a memory-bound accelerator) and the prediction with it (the tokens per step the model expects, over v).

Workloads: ``chat`` (short questions in the chat template) and ``rewrite`` (rewrite or extract a passage
given in the prompt: the answer copies from the input, where prompt lookup shines).
"""

from __future__ import annotations

import asyncio
import time

from app.api.protocol import ChatCompletionRequest
from app.config import EngineConfig, ModelConfig, ServedModelConfig, SpecConfig
from app.server import ModelServer
from app.spec.policy import expected_tokens_per_step

TARGET_SOURCE = "smollm2-135m-instruct-gptq"
NGRAM, SPEC = "target-ngram", "target-spec"

CHAT = [
    "What is the capital of France? Answer in two sentences.",
    "Give three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Describe how to make a cup of tea.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
]
PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to five books "
    "for two weeks. Late returns cost ten cents per day. The reading room on the second floor is quiet at all times.",
    "Our team meets every Monday at ten. Alice presents the weekly numbers, Bob reviews open tickets, and Carol plans "
    "the next release. Meetings end at eleven. Notes are shared in the team folder by the end of the day.",
    "To reset your password, open the settings page, choose security, and click reset password. A link is sent to "
    "your email address. The link expires after thirty minutes. If it expires, request a new one from the same page.",
    "The recipe needs two cups of flour, one cup of sugar, three eggs, and a spoon of butter. Mix the flour and sugar, "
    "add the eggs one at a time, then the butter. Bake for forty minutes at one hundred and eighty degrees.",
    "The train to the coast leaves from platform four at eight fifteen. It stops at three stations on the way and "
    "arrives just before eleven. Tickets can be bought on board, but they cost more than at the station.",
    "Our garden has two apple trees, a small pond, and a row of tomato plants along the fence. In summer we water "
    "the plants every evening. The apples are ready to pick at the end of September.",
    "The museum is closed on Mondays. On other days it opens at ten and closes at five. Entry is free for children "
    "under twelve. Guided tours start every hour from the main hall and last about forty minutes.",
    "Please bring a pencil, an eraser, and a calculator to the exam. Phones must be switched off and left in your "
    "bag. The exam lasts two hours, and no one may leave during the first thirty minutes.",
]
REWRITE = [f"Rewrite the following text exactly, fixing nothing:\n\n{p}" for p in PASSAGES]
WORKLOADS = {"chat": CHAT, "rewrite": REWRITE}


def run_spec_bench(max_tokens: int = 96, concurrencies: tuple[int, ...] = (1, 8), num_speculative_tokens: int = 4,
                   dtype: str = "auto", gptq_kernel: str = "auto", rounds: int = 2, temperature: float = 0.0) -> dict:
    draft = ModelServer(ServedModelConfig(model=ModelConfig(dtype=dtype, max_model_len=2048)))
    target_config = ServedModelConfig(
        model=ModelConfig(source=TARGET_SOURCE, quantization="gptq", dtype=dtype, max_model_len=2048),
        engine=EngineConfig(cpu_gptq_kernel=gptq_kernel, speculative=[
            SpecConfig(drafter="ngram", num_speculative_tokens=num_speculative_tokens, served_name=NGRAM),
            SpecConfig(drafter="model", draft="draft", num_speculative_tokens=num_speculative_tokens, served_name=SPEC),
        ]),
    )
    target = ModelServer(target_config, draft_client=draft.propose)
    try:
        return asyncio.run(_measure(target, draft, max_tokens, concurrencies, num_speculative_tokens, rounds, temperature))
    finally:
        target.shutdown(timeout_s=5)
        draft.shutdown(timeout_s=5)


async def _measure(target: ModelServer, draft: ModelServer, max_tokens: int, concurrencies, k: int, rounds: int,
                   temperature: float) -> dict:
    alone = target.info.name
    await _run(target, alone, CHAT[:2], 8, 2)  # warm-up: first steps of each shape pay one-time costs
    await _run(target, NGRAM, REWRITE[:2], 16, 2)
    await _run(target, SPEC, CHAT[:2], 16, 2)
    draft_alone = await _run(draft, draft.info.name, CHAT[:4], max_tokens, 1)
    draft_s_per_token = 1 / draft_alone["output_tok_per_s"]
    result: dict = {"spec": {"target": TARGET_SOURCE, "draft": draft.info.name, "max_tokens": max_tokens,
                             "num_speculative_tokens": k, "concurrencies": list(concurrencies), "rounds": rounds,
                             "temperature": temperature,
                             "gptq_kernel": _gptq_kernel(target.config.engine.cpu_gptq_kernel)},
                    "draft_single_stream_tok_per_s": draft_alone["output_tok_per_s"], "runs": []}
    for workload, prompts in WORKLOADS.items():
        for concurrency in concurrencies:
            # Each round: alone, n-gram, draft model, alone again, so that every drafter's run sits between two
            # runs of the target alone; the rounds' runs are pooled (this machine drifts 15-40% within an hour
            # and by ~20% from one minute to the next, more than some of the effects measured here).
            pooled: dict[str, list[dict]] = {"none": [], "ngram": [], "model": []}
            for _ in range(rounds):
                for drafter, name in (("none", alone), ("ngram", NGRAM), ("model", SPEC), ("none", alone)):
                    pooled[drafter].append(await _run(target, name, prompts, max_tokens, concurrency, temperature))
            runs = {drafter: _pool(parts) for drafter, parts in pooled.items()}
            base = runs["none"]
            target_s_per_token = concurrency / base["output_tok_per_s"]  # one stream's share of a step
            for drafter, run in runs.items():
                row = _row(workload, concurrency, drafter, run, base, k,
                           draft_s_per_token / target_s_per_token if drafter == "model" else 0.0)
                result["runs"].append(row)
                print(_format_row(row), flush=True)
    return result


def _gptq_kernel(setting: str) -> str:
    """Which kernel ran the target's 4-bit layers (``auto``: as timed on this CPU, cached; see the start-up log)."""
    return "as measured on this CPU (engine.cpu_gptq_kernel: auto)" if setting == "auto" else setting


async def _run(server: ModelServer, model: str, prompts: list[str], max_tokens: int, concurrency: int,
               temperature: float = 0.0) -> dict:
    """Every prompt once, ``concurrency`` at a time; tokens/s and the engine's counters over the run."""
    before = server.engine.stats()
    queue = list(prompts)
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            prompt = queue.pop(0)
            # greedy: every drafter emits the target's own tokens, so runs do the same work and may stop at EOS;
            # sampled: the tokens differ from run to run, so every answer runs to max_tokens
            request = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                            temperature=temperature, ignore_eos=temperature > 0)
            answer = await server.serving.chat(request)
            tokens += answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    after = server.engine.stats()
    spec = _delta((after.get("spec_by_name") or {}).get(model, {}), (before.get("spec_by_name") or {}).get(model, {}))
    return {"output_tok_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 3),
            "steps": after.get("num_steps", 0) - before.get("num_steps", 0), "spec": spec}


def _pool(runs: list[dict]) -> dict:
    """Several runs of one configuration as one: their tokens, wall time, steps and counters added up."""
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    spec = {key: sum(r["spec"][key] for r in runs) for key in runs[0]["spec"]}
    return {"output_tok_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 3),
            "steps": sum(r["steps"] for r in runs), "spec": spec}


def _delta(after: dict, before: dict) -> dict:
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {key: after.get(key, 0) - before.get(key, 0) for key in keys}


def _row(workload: str, concurrency: int, drafter: str, run: dict, base: dict, k: int, cost_ratio: float) -> dict:
    spec, tokens = run["spec"], max(run["tokens"], 1)
    drafted, accepted, drafts = spec["num_draft_tokens"], spec["num_accepted_tokens"], spec["num_drafts"]
    a = accepted / drafted if drafted else 0.0
    mean_k = drafted / drafts if drafts else 0.0
    share = drafts / (run["steps"] * concurrency) if run["steps"] else 0.0  # of the sequence-steps, those that drafted
    # Leviathan et al. for the steps that drafted (E(a, k) tokens for 1 + k c of a target step), plain steps as they are
    gain = (1 - share) + share * expected_tokens_per_step(a, round(mean_k))
    predicted = gain / ((1 - share) + share * (1 + mean_k * cost_ratio)) if drafts else 1.0
    # the same with the cost this run's steps measured against the target's plain steps (drafting and waiting
    # included): what is left between it and the measured speed-up is the acceptance model's tokens per step
    v = _step_cost(run, base) if drafts else None
    with_v = gain / v if v else None
    speedup = run["output_tok_per_s"] / base["output_tok_per_s"]
    return {
        "workload": workload, "concurrency": concurrency, "drafter": drafter,
        "output_tok_per_s": run["output_tok_per_s"], "speedup": round(speedup, 3),
        "acceptance_rate": round(a, 3), "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "mean_draft_length": round(mean_k, 2),
        # each step is one forward pass for every running stream (all of them, but for the run's tail)
        "target_passes_per_token": round(run["steps"] * concurrency / tokens, 3),
        "draft_share": round(share, 3),
        "cost_ratio": round(cost_ratio, 3),
        "leviathan_speedup": round(predicted, 3),
        "measured_over_predicted": round(speedup / predicted, 3) if drafts else None,
        "verify_cost": round(v, 3) if v else None,
        "prediction_with_verify_cost": round(with_v, 3) if with_v else None,
        "measured_over_prediction_with_verify_cost": round(speedup / with_v, 3) if with_v else None,
    }


def _step_cost(run: dict, base: dict) -> float | None:
    """The run's mean step time over the target alone's (same prompts, same concurrency)."""
    if not (run["steps"] and base["steps"] and base["wall_s"]):
        return None
    return (run["wall_s"] / run["steps"]) / (base["wall_s"] / base["steps"])


def _format_row(row: dict) -> str:
    return (f"{row['workload']:8s} c={row['concurrency']:<2d} {row['drafter']:6s} {row['output_tok_per_s']:7.1f} tok/s "
            f"x{row['speedup']:.2f}  a={row['acceptance_rate']:.2f} len={row['mean_accepted_length']:.2f} "
            f"passes/token={row['target_passes_per_token']:.2f} drafted {row['draft_share']:.0%} of steps "
            f"c={row['cost_ratio']:.2f} leviathan x{row['leviathan_speedup']:.2f} "
            f"v={row['verify_cost'] or 1:.2f} with v x{row['prediction_with_verify_cost'] or row['leviathan_speedup']:.2f}")


def markdown(result: dict) -> str:
    rows = ["| workload | streams | drafter | tok/s | speed-up | acceptance | mean accepted length | target passes / token | "
            "steps drafting | c | Leviathan | measured / Leviathan | v | prediction with v | measured / it |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        ratio = "" if r["measured_over_predicted"] is None else r["measured_over_predicted"]
        v, with_v, over_v = (r.get(key) or "" for key in ("verify_cost", "prediction_with_verify_cost",
                                                        "measured_over_prediction_with_verify_cost"))
        rows.append(f"| {r['workload']} | {r['concurrency']} | {r['drafter']} | {r['output_tok_per_s']} | {r['speedup']} | "
                    f"{r['acceptance_rate']} | {r['mean_accepted_length']} | {r['target_passes_per_token']} | "
                    f"{r['draft_share']} | {r['cost_ratio']} | {r['leviathan_speedup']} | {ratio} | {v} | {with_v} | {over_v} |")
    return "\n".join(rows)
