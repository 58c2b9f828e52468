"""Recording and replaying speculative rounds offline: the logic behind ``benchmarks/studies/round_signals.py``.

The study asks which signals known before a drafter step predict a rejected draft, and how much of the
gain an oracle over every outcome would find the runtime's schedule reaches (its docstring has the
questions and the command lines).  The figures rest on one rule, which the tests check here: every
replayed schedule, the foresight bound and the oracle price a round exactly alike (target pass by rows,
padded to the exact passes' minimum; the drafter's catch-up of one row after a rejection, two after a
fully accepted round, every token of a round it did not draft), so that the oracle is a ceiling.

:func:`collect` and :func:`add_eagle` record a signals file from a bundle; :class:`Prices` prices rounds
from a bench run or a machine's costs; :func:`replay` walks the recorded answers under a policy
(:func:`adaptive_policy`: the runtime's own schedule; :func:`foresight_policy`, :func:`peeking_policy`,
:func:`informed_policy`: schedules told more than the runtime knows); :func:`oracle` is the bound;
:func:`analyze`, :func:`signal_value` and :func:`before_the_step` print the study's tables.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge_spec.bench.runs import load_bench_prompts, pass_prices
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.autoregressive import choose_token
from edge_spec.runtime.loops.config import ChainConfig
from edge_spec.runtime.propose.model import drafter_probs, draw_index, softmax
from edge_spec.runtime.propose.ngrams import LOOKUP_MIN_N, NgramLookup
from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, RequestAcceptance
from edge_spec.runtime.schedule.policy import AdaptiveGamma, CostModel
from edge_spec.runtime.schedule.sources import LookupChoice
from edge_spec.runtime.verify.sampling import SamplingParams

CHAIN = 16  # longest lookup chain recorded (run = how many of its tokens the target would accept)
FIELDS = (
    "prompt",
    "category",
    "position",
    "draft_ok",
    "draft_conf",
    "target_top",
    "target_margin",
    "guess_ok",
    "guess_match",
    "lookup_ok",
    "lookup_match",
    "lookup_run",
    "lookup_len",
    "target_entropy",
    "token",
    "draft_second",
    "draft_entropy",
    "pending_q",
    "draft_hidden",
)


def collect(args: argparse.Namespace) -> None:
    engine = Engine.from_bundle(
        args.bundle,
        threads=args.threads,
        config=ChainConfig(gamma=1, adaptive=False, proposers=("model", "guess")),
        draft_head=args.head,
    )
    prompts = []
    for path in args.prompts or [None]:
        prompts += load_bench_prompts(path, None, None)
    rows: dict[str, list] = {name: [] for name in FIELDS}
    for index, item in enumerate(tqdm(prompts, desc="prompts")):
        prompt = item["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        params = SamplingParams(temperature=args.temperature, seed=args.seed + index, sampler="coupled")
        answer = engine.complete(
            messages,
            max_new_tokens=args.max_tokens,
            temperature=params.temperature,
            seed=params.seed,
            sampler=params.sampler,
        ).token_ids
        ids = engine.prompt_ids(messages)
        sequence = ids + answer
        target, body = engine.bundle.target, engine.bundle.drafter.body
        target.reset()
        body.reset()
        logits = target.forward(sequence, len(answer) + 1)["logits"]  # row j predicts answer[j]
        hidden = body.forward(sequence, len(answer) + 1)["hidden_states"]
        target.reset()
        body.reset()
        chosen = [choose_token(logits[j], params, None, len(ids) + j) for j in range(len(answer))]
        if chosen != answer:
            raise SystemExit(f"prompt {index}: teacher-forced target does not reproduce the answer")
        ngrams = NgramLookup(min_n=1)
        first_logits, first_ids = engine.bundle.drafter.head(hidden[0])
        pending = softmax(first_logits), first_ids  # the drafter's own distribution at answer[0]
        for j in range(1, len(answer)):  # a round at j: answer[j-1] is pending, answer[j] is next
            head_logits, head_ids = engine.bundle.drafter.head(hidden[j])
            probs = drafter_probs(head_logits, params)
            own = softmax(head_logits)  # the drafter's own distribution, whatever the sampling
            ranked = np.sort(own)
            best = draw_index(probs, head_logits, head_ids, params, None, len(ids) + j, engine.bundle.target.vocab_size)
            proposal = best if head_ids is None else int(head_ids[best])
            previous = softmax(logits[j - 1].astype(np.float64))  # the target row that produced answer[j-1]
            top2 = np.sort(previous)[-2:]
            prefix = sequence[: len(ids) + j]
            guess, match = _match(ngrams, prefix, 1)
            look, look_match = _match(ngrams, prefix, LOOKUP_MIN_N)
            chain = ngrams.continuation(prefix, CHAIN, min_n=LOOKUP_MIN_N)
            agreed = next(
                (k for k, (a, b) in enumerate(zip(chain, answer[j:])) if a != b), min(len(chain), len(answer) - j)
            )
            values = (
                index,
                item["category"],
                j,
                proposal == answer[j],
                float(probs[best]),
                float(top2[1]),
                float(top2[1] - top2[0]),
                guess == answer[j],
                match,
                look == answer[j],
                look_match,
                agreed,
                len(chain),
                float(-(previous * np.log(previous + 1e-30)).sum()),
                answer[j],
                float(ranked[-2]) if len(own) > 1 else 0.0,
                float(-(ranked * np.log(ranked + 1e-30)).sum()),
                _probability_of(*pending, answer[j - 1]),
                np.asarray(hidden[j], np.float16),
            )
            pending = own, head_ids
            for name, value in zip(FIELDS, values):
                rows[name].append(value)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.output, **{name: np.array(values) for name, values in rows.items()})
    print(f"wrote {args.output}: {len(rows['prompt'])} positions from {len(prompts)} prompts")


def _probability_of(probs: np.ndarray, ids: np.ndarray | None, token: int) -> float:
    """The drafter's own probability of ``token`` over its head's rows ``ids`` (0 when the head did not
    score that row)."""
    where = np.flatnonzero(ids == token) if ids is not None else [token]
    return float(probs[where[0]]) if len(where) else 0.0


HALVES = Path("halves")  # --fit-on: split the analyzed answers by prompt instead of reading a second file
EAGLE_CHAIN = 4  # chained EAGLE drafts recorded per position


def add_eagle(args: argparse.Namespace) -> None:
    """Add the EAGLE head's drafts to a signals file: at every recorded position, the chain of up to
    ``EAGLE_CHAIN`` drafts the head would make there (fed its own drafts and hidden states, as in a
    round), whether each is right with the ones before it, and the head's confidence in each.

    The head reads the target's features of a teacher-forced pass over prompt + answer (the answers of
    the file, whose first token the pass itself reproduces), so its first draft at each position is
    exactly the one the runtime would make there."""
    data = dict(np.load(args.add_eagle))
    engine = Engine.from_bundle(
        args.bundle,
        threads=args.threads,
        eagle_head=args.eagle_head,
        config=ChainConfig(gamma=1, adaptive=False, proposers=("eagle", "guess")),
    )
    eagle, target = engine.bundle.eagle, engine.bundle.target
    prompts = []
    for path in args.prompts or [None]:
        prompts += load_bench_prompts(path, None, None)
    ok = np.zeros((len(data["prompt"]), EAGLE_CHAIN), bool)
    conf = np.zeros((len(data["prompt"]), EAGLE_CHAIN), np.float32)
    for index in tqdm(np.unique(data["prompt"]), desc="prompts"):
        rows = np.flatnonzero(data["prompt"] == index)
        prompt = prompts[int(index)]["prompt"]
        ids = engine.prompt_ids(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        target.reset()
        head_out = target.forward(ids, 1)
        answer = [int(np.argmax(head_out["logits"][-1]))] + [int(t) for t in data["token"][rows]]
        tail = target.forward(answer, len(answer))
        if not np.array_equal(tail["logits"][:-1].argmax(-1), answer[1:]):
            raise SystemExit(f"prompt {index}: teacher-forced target does not reproduce the answer")
        sequence = ids + answer
        features = np.concatenate([head_out["features"], tail["features"]])
        fused = eagle.fc.run(None, {"features": features[None].astype(np.float32)})[0][0]
        eagle.head.reset()
        pairs = sequence[1:]  # pair t: embedding of token t + 1, fused feature of position t
        for row, j in zip(rows, data["position"][rows]):
            last = len(ids) + int(j) - 2  # the last pair a round at j has: token answer[j-1], feature before it
            eagle.head.rewind(min(eagle.head.length, last))  # forget the drafts of the previous position
            feed = pairs[eagle.head.length : last + 1]
            out = eagle.head.forward(
                feed,
                1,
                inputs={
                    "inputs_embeds": eagle.embed(feed).astype(np.float32),
                    "hidden": np.ascontiguousarray(fused[last + 1 - len(feed) : last + 1]),
                },
            )
            logits, draft_ids = (
                eagle.lm_head(out["hidden_states"][-1]) if eagle.lm_head else (out["logits"][-1], eagle.draft_ids)
            )
            eagle._hidden = out["hidden_out"][-1]
            right = True
            for k in range(EAGLE_CHAIN):
                probs = softmax(logits)
                best = int(np.argmax(logits))
                token = best if draft_ids is None else int(draft_ids[best])
                position = len(ids) + int(j) + k
                right = right and position < len(sequence) and token == sequence[position]
                ok[row, k], conf[row, k] = right, float(probs[best])
                if not right:
                    break
                logits, draft_ids = eagle.step(token)
    target.reset()
    eagle.head.reset()
    np.savez(args.add_eagle, **data, eagle_ok=ok, eagle_conf=conf)
    print(
        f"added the EAGLE head's drafts ({args.eagle_head or 'default head'}) to {args.add_eagle}: first draft "
        f"right at {ok[:, 0].mean():.3f} of {len(ok)} positions"
    )


def _match(ngrams: NgramLookup, prefix: list[int], min_n: int) -> tuple[int, int]:
    """(proposed token or -1, length of the matched suffix or 0)."""
    for n in range(ngrams.max_n, min_n - 1, -1):
        proposal = ngrams.continuation(prefix, 1, min_n=n)
        if proposal:
            return proposal[0], n
    return -1, 0


class Prices:
    """Latencies (s) that price replayed rounds: target pass by rows, drafter pass by rows, head, and time
    outside ORT per round; measured by a bench run, or given as a machine's costs."""

    def __init__(
        self, target: dict[int, float], draft: dict[int, float], head: float = 0.0, outside: float = 0.0
    ) -> None:
        self.target, self.draft, self.head, self.outside = target, draft, head, outside
        self._curve = CostModel(0.0, target)  # between or past the measured sizes, priced as the planner prices them
        self.min_rows = 2  # exact passes pad one-row passes (1: one-row passes are exact on the machine priced)

    @classmethod
    def measured(cls, bench_json: Path) -> "Prices":
        """The latencies a bench run measured (its fixed γ = 1 rounds price the time outside ORT)."""
        data = json.loads(bench_json.read_text())
        prices = pass_prices(data["records"])
        outside, rounds, heads, steps = 0.0, 0, 0.0, 0
        for record in data["records"]:
            if record["mode"].startswith("spec") and "@γ1" in record["mode"] and "lookup" not in record["mode"]:
                ort = sum(s for _, s in record["target_passes"].values()) + sum(
                    s for _, s in record["draft_passes"].values()
                )
                outside += record["decode_seconds"] - ort
                rounds += record["target_calls"]
                heads += record["head_seconds"]
                steps += record["draft_steps"]
        return cls(
            {int(n): price for (role, n), price in prices.items() if role == "target"},
            {int(n): price for (role, n), price in prices.items() if role == "draft"},
            heads / steps,
            (outside - heads) / rounds,
        )

    @classmethod
    def of_machine(cls, machine: str) -> "Prices":
        """``"48,56,82,100,121/17.4"``: target pass ms by rows, then the drafter step ms (body + head)."""
        rows, step = machine.split("/")
        return cls(
            {n: float(ms) / 1e3 for n, ms in enumerate(rows.split(","), start=1)},
            {n: float(step) / 1e3 for n in (1, 2, 3)},
        )

    def with_drafter(self, seconds: float) -> "Prices":
        """The same target, with every drafter step (a catch-up pass too, head included) at ``seconds``: what
        a schedule would reach with a cheaper drafter of the same acceptance, such as a feature-level head."""
        prices = Prices(self.target, {n: seconds for n in self.draft}, 0.0, self.outside)
        prices.min_rows = self.min_rows
        return prices

    def verify(self, drafts: int) -> float:
        rows = max(drafts + 1, self.min_rows)  # exact mode: a pass has at least min_rows rows
        return self._curve.verify_cost(rows) + self.outside

    def drafter(self, rows: int) -> float:
        return self.draft[max(k for k in self.draft if k <= rows)] + self.head  # nearest measured size below


# ("draft" | "lookup" | "guess" | "plain": a one-row pass | "dropped": a guess, or with 0 drafts a one-row
# pass, after an unused drafter step, drafts)
Choice = tuple[str, int]


def replay(
    data: dict[str, np.ndarray], prices: Prices, policy: Callable[[int, dict], Choice]
) -> dict[str, tuple[float, int]]:
    """Seconds and tokens per category when ``policy`` picks every round of every answer.

    A drafter round's first step feeds every committed token the drafter has not seen (a catch-up pass
    over that many rows); further drafts are one-row steps whose proposals are the teacher-forced ones
    (the same as long as the earlier drafts were right, which is all that acceptance depends on).  A draft
    the stop rule drafted and then dropped costs its step too (the policy marks it in ``state``)."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for prompt in np.unique(data["prompt"]):
        rows = np.flatnonzero(data["prompt"] == prompt)
        state: dict = {}
        j, seconds, unseen = 0, 0.0, 1
        while j < len(rows):
            i = rows[j]
            state["unread"] = unseen
            kind, drafts = policy(i, state)
            drafts = 0 if kind == "plain" or (kind, drafts) == ("dropped", 0) else max(1, min(drafts, len(rows) - j))
            if kind == "draft":
                oks = [bool(data["draft_ok"][rows[min(j + k, len(rows) - 1)]]) for k in range(drafts)]
                accepted = next((k for k, ok in enumerate(oks) if not ok), drafts)
                seconds += prices.drafter(unseen) + (drafts - 1) * prices.drafter(1) + prices.verify(drafts)
                if state.get("dropped"):  # the round drafted one more draft and dropped it: its step ran
                    seconds += prices.drafter(1)
                confidences = [float(data["draft_conf"][rows[min(j + k, len(rows) - 1)]]) for k in range(drafts)]
                state["outcome"] = ("draft", drafts, accepted, confidences)
                unseen = 2 if accepted == drafts else 1
            elif kind == "plain":  # a one-row pass (one-row passes exact, and the guess not worth its row)
                accepted = 0
                seconds += prices.verify(0)
                state["outcome"] = (kind, 0, 0, [])
                unseen += 1
            else:
                accepted = (
                    min(int(data["lookup_run"][i]), drafts) if kind == "lookup" else int(data["guess_ok"][i]) * drafts
                )
                seconds += prices.verify(drafts) + (prices.drafter(unseen) if kind == "dropped" else 0.0)
                state["outcome"] = (kind, drafts, accepted, [])
                unseen = 1 + accepted if kind == "dropped" else unseen + 1 + accepted
            if data["lookup_len"][i]:  # what lookup offered, taken or not, is judged on the produced tokens
                state["offer"] = (i, min(1 + accepted, len(rows) - j))
            j += 1 + accepted
        cell = totals[str(data["category"][rows[0]])]
        cell[0] += seconds
        cell[1] += len(rows)
    return {category: (s, n) for category, (s, n) in totals.items()}


def oracle(data: dict[str, np.ndarray], prices: Prices, gamma_max: int = 4) -> dict[str, tuple[float, int]]:
    """The fastest schedule with every outcome known in advance (dynamic programming over positions and
    the tokens the drafter has yet to read, priced as :func:`replay` prices them): the ceiling for any
    policy on these answers."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    unread = max(prices.draft)  # a catch-up over more rows costs what the longest measured one does
    for prompt in np.unique(data["prompt"]):
        rows = np.flatnonzero(data["prompt"] == prompt)
        n = len(rows)
        best = np.zeros((n + 1, unread + 1))  # [position, unread tokens]: seconds to the end
        for j in range(n - 1, -1, -1):
            i = rows[j]
            for u in range(1, unread + 1):
                after = lambda accepted, u_next: best[min(j + 1 + accepted, n), min(u_next, unread)]
                guessed = int(data["guess_ok"][i])
                options = [prices.verify(1) + after(guessed, u + 1 + guessed), prices.verify(0) + after(0, u + 1)]
                for g in range(1, gamma_max + 1):
                    oks = [bool(data["draft_ok"][rows[min(j + k, n - 1)]]) for k in range(g)]
                    accepted = next((k for k, ok in enumerate(oks) if not ok), g)
                    options.append(
                        prices.drafter(u)
                        + (g - 1) * prices.drafter(1)
                        + prices.verify(g)
                        + after(accepted, 2 if accepted == g else 1)
                    )
                    if data["lookup_len"][i]:
                        run = min(int(data["lookup_run"][i]), g)
                        options.append(prices.verify(g) + after(run, u + 1 + run))
                best[j, u] = min(options)
        cell = totals[str(data["category"][rows[0]])]
        cell[0] += best[0, 1]
        cell[1] += n
    return {category: (s, n) for category, (s, n) in totals.items()}


def foresight_policy(data: dict[str, np.ndarray], prices: Prices, gamma_max: int = 4) -> Callable[[int, dict], Choice]:
    """The best any schedule driven by the drafter's confidence can do, and more: it knows, before
    drafting, the confidence of every draft the round could make (the runtime learns each only after
    paying its step), turns each into the acceptance actually measured for its confidence bin over
    these answers (a perfect calibration), and picks the round that minimizes the expected time to the
    end of the answer (dynamic programming over positions and the tokens the drafter has yet to read,
    priced as :func:`replay` prices them).  Lookup and guesses are priced the same way
    (rates by matched length); a later draft's acceptance is measured by its own and its predecessor's
    confidence bins, since accepted drafts come in streaks.  Outcomes stay unknown to it, unlike the
    oracle's."""
    from edge_spec.runtime.schedule.acceptance import confidence_bin

    bins = np.array([confidence_bin(float(c)) for c in data["draft_conf"]])
    ok = data["draft_ok"].astype(bool)
    count = bins.max() + 1
    rate_by_bin = np.array([ok[bins == b].mean() if (bins == b).any() else 0.0 for b in range(count)])
    p_draft = rate_by_bin[bins]  # a round's first draft
    # later drafts: given the draft before was accepted, by both drafts' confidence bins (streaks)
    follows = np.r_[False, (data["prompt"][1:] == data["prompt"][:-1]) & ok[:-1]]
    previous = np.r_[0, bins[:-1]]
    streak = np.zeros((count, count))
    for a in range(count):
        for b in range(count):
            cell = follows & (previous == a) & (bins == b)
            streak[a, b] = ok[cell].mean() if cell.sum() >= 5 else rate_by_bin[b]
    p_later = streak[previous, bins]
    matched = data["lookup_match"]
    lookup_first = {m: float((data["lookup_run"][matched == m] > 0).mean()) for m in np.unique(matched[matched > 0])}
    runs = data["lookup_run"][data["lookup_len"] > 0]
    lookup_later = float((runs >= 2).sum() / max((runs >= 1).sum(), 1))
    guess_rate = {m: float(data["guess_ok"][data["guess_match"] == m].mean()) for m in np.unique(data["guess_match"])}
    plans: dict[tuple[int, int], Choice] = {}
    unread = max(prices.draft)  # a catch-up over more rows costs what the longest measured one does
    for prompt in np.unique(data["prompt"]):
        rows = np.flatnonzero(data["prompt"] == prompt)
        n = len(rows)
        expected = np.zeros((n + 1, unread + 1))  # [position, unread tokens]: expected seconds to the end
        for j in range(n - 1, -1, -1):
            i = rows[j]
            g_ok = guess_rate.get(int(data["guess_match"][i]), 0.0)
            for u in range(1, unread + 1):
                after = lambda k, u_next: expected[min(j + 1 + k, n), min(u_next, unread)]
                options = [
                    (prices.verify(1) + g_ok * after(1, u + 2) + (1 - g_ok) * after(0, u + 1), ("guess", 1)),
                    (prices.verify(0) + after(0, u + 1), ("plain", 0)),
                ]
                for g in range(1, gamma_max + 1):
                    chain = [(p_draft if k == 0 else p_later)[rows[min(j + k, n - 1)]] for k in range(g)]
                    options.append(
                        (
                            prices.drafter(u)
                            + (g - 1) * prices.drafter(1)
                            + prices.verify(g)
                            + _chain_expectation(chain, lambda k: after(k, 2 if k == g else 1)),
                            ("draft", g),
                        )
                    )
                    if data["lookup_len"][i] and g <= data["lookup_len"][i]:
                        first = lookup_first.get(int(matched[i]), 0.0)
                        options.append(
                            (
                                prices.verify(g)
                                + _chain_expectation([first] + [lookup_later] * (g - 1), lambda k: after(k, u + 1 + k)),
                                ("lookup", g),
                            )
                        )
                expected[j, u], plans[int(i), u] = min(options, key=lambda option: option[0])
    return lambda i, state: plans[int(i), min(state["unread"], unread)]


KNOWLEDGE = {
    "lookup": "how far each lookup match runs",
    "skip": "which first drafts the target rejects",
    "stop": "where each chain of accepted drafts breaks",
}


def informed_policy(
    data: dict[str, np.ndarray], schedule: Callable[[int, dict], Choice], know: str, gamma_max: int
) -> Callable[[int, dict], Choice]:
    """The schedule told one kind of outcome (``KNOWLEDGE``), to ask where the oracle's gain lies: take
    every lookup match exactly as far as the target accepts it ("lookup"); give a round whose first draft
    the target would reject a guess instead of the drafter step ("skip"); draft a round whose first draft
    is accepted exactly as far as its drafts are ("stop").  Otherwise the schedule decides, and it learns
    from every round as it would."""
    last = len(data["prompt"]) - 1

    def run(i: int) -> int:
        k = 0
        while (
            k < gamma_max and i + k <= last and data["prompt"][i + k] == data["prompt"][i] and data["draft_ok"][i + k]
        ):
            k += 1
        return k

    def policy(i: int, state: dict) -> Choice:
        kind, drafts = schedule(i, state)
        if know == "lookup" and data["lookup_len"][i]:
            taken = min(int(data["lookup_run"][i]), int(data["lookup_len"][i]), gamma_max)
            if taken:
                return "lookup", taken
            if kind == "lookup":
                return "guess", 1
        drafter_round = kind == "draft" or (kind == "dropped" and know == "skip")
        if drafter_round and know in ("skip", "stop") and (know == "stop") == bool(data["draft_ok"][i]):
            state.pop("dropped", None)  # the round is replaced: the step the schedule dropped did not run
            return ("draft", run(i)) if know == "stop" else ("guess", 1)
        return kind, drafts

    return policy


def peeking_policy(
    data: dict[str, np.ndarray], prices: Prices, gamma_max: int, calibration: AcceptanceCalibration | None = None
) -> Callable[[int, dict], Choice]:
    """The default told, before each round, the confidence of every draft the round could make -- the
    foresight's knowledge, but planned with the runtime's own per-request estimates, lookup choice and price
    of time (the foresight plans with the whole set's rates, so it cannot follow one request as the runtime
    does).  Whenever the default would draft, the round's length is the ``L`` (0: the free guess instead)
    maximizing ``E[tokens | L] − ρ·cost(L)`` with each draft's acceptance estimated from its known confidence,
    as the stop rule weighs a draft it has paid for; so it never pays a step it then drops.  What this
    reaches bounds what learning confidences earlier could add to the runtime's schedule."""
    schedule = adaptive_policy(data, prices, True, gamma_max, calibration)
    costs = _schedule_costs(prices, gamma_max)
    last = len(data["prompt"]) - 1

    def policy(i: int, state: dict) -> Choice:
        kind, drafts = schedule(i, state)
        state.pop("dropped", None)  # no step is paid for a draft the round does not keep
        if kind not in ("draft", "dropped"):
            return kind, drafts
        plan, estimates = state["policy"], state["policy"].estimates
        spare = estimates.guess(int(data["guess_match"][i]))
        rate = plan.plan(costs, spare).rate
        best, best_value = 0, 1 + spare - rate * costs.expected_cost(0, 0, 0, spare)
        survive, expected = 1.0, 1.0
        for length in range(1, plan.ceiling(costs) + 1):
            k = i + length - 1
            if k > last or data["prompt"][k] != data["prompt"][i]:
                break
            survive *= estimates.acceptance(float(data["draft_conf"][k]))
            expected += survive
            value = expected - rate * (length * costs.draft + costs.verify_cost(length + 1) + survive * costs.catch_up)
            if value > best_value:
                best, best_value = length, value
        return ("draft", best) if best else ("guess", 1)

    return policy


def _schedule_costs(prices: Prices, gamma_max: int) -> CostModel:
    """The cost model the runtime's schedule would measure at these prices."""
    return CostModel(
        prices.drafter(1),
        {n: prices.verify(n - 1) - prices.outside for n in range(1, gamma_max + 2)},
        catch_up=max(prices.drafter(2) - prices.drafter(1), 0.0),
        overhead=prices.outside,
    )


def _chain_expectation(acceptance: list[float], after: Callable[[int], float]) -> float:
    """E[time after the round] when draft k is accepted with ``acceptance[k]`` once the ones before were."""
    total, survive = 0.0, 1.0
    for k, a in enumerate(acceptance):
        total += survive * (1 - a) * after(k)
        survive *= a
    return total + survive * after(len(acceptance))


def adaptive_policy(
    data: dict[str, np.ndarray],
    prices: Prices,
    lookup: bool,
    gamma_max: int = 4,
    calibration: AcceptanceCalibration | None = None,
    learn_drops: bool = True,
    rate_scale: float = 1.0,
) -> Callable[[int, dict], Choice]:
    """The runtime's schedule as the chain's planner runs it: a lookup match when ``LookupChoice``
    takes it, else a round planned by :class:`AdaptiveGamma` whose :class:`DraftRound` sees each
    draft's recorded confidence, else a free guess.  One calibration is carried over every prompt, as
    the engine carries it over requests (``calibration``: where it starts).  ``learn_drops`` False: the
    schedule as it was before the drafts it dropped taught it anything: the table of later drafts, and the
    request's first-draft estimate when a round's only draft was dropped (``--ignore-drops``).
    ``rate_scale``: the stop rule's price of time (the rate a round must beat) scaled, to ask whether the
    rule is tuned (``--rate-scale``)."""
    costs = _schedule_costs(prices, gamma_max)
    carried = calibration or AcceptanceCalibration()

    def policy(i: int, state: dict) -> Choice:
        schedule = state.setdefault("policy", AdaptiveGamma(gamma_max, RequestAcceptance(carried)))
        choice = state.setdefault("lookup", LookupChoice(carried.sequence, schedule.estimates))
        dropped = state.pop("dropped", False)  # the last round's, priced by replay
        if "outcome" in state:
            kind, drafted, accepted, confidences = state.pop("outcome")
            if kind == "draft":
                schedule.update(drafted, accepted, confidences, dropped=dropped and learn_drops)
            if kind == "dropped" and learn_drops:  # the round's only draft dropped: what it was worth
                schedule.update(0, 0, dropped=True)
        if "offer" in state:  # as the planner judges every offer: its drafts against the tokens produced
            offered, produced = state.pop("offer")
            run, length = int(data["lookup_run"][offered]), int(data["lookup_len"][offered])
            choice.judge(
                list(range(length)), int(data["lookup_match"][offered]), [k if k < run else -1 for k in range(produced)]
            )
        if "guessed" in state:  # every round checks the guess it could have carried (as the planner does)
            guessed = state.pop("guessed")
            schedule.estimates.record_guess(int(data["guess_match"][guessed]), bool(data["guess_ok"][guessed]))
        state["guessed"] = i
        spare = schedule.estimates.guess(int(data["guess_match"][i]))
        if prices.min_rows < 2 and not _guess_pays(costs, spare):  # no pad row: the guess must pay its row
            spare = 0.0
        if lookup and data["lookup_len"][i]:
            model_rate = schedule.plan(costs, spare).rate
            take = choice.lookup_gamma(
                int(data["lookup_len"][i]), int(data["lookup_match"][i]), costs, gamma_max, model_rate, adaptive=True
            )
            if take:
                return "lookup", take
        rule = schedule.begin_round(costs, spare=spare)
        if rule is None:
            return ("guess", 1) if spare or prices.min_rows >= 2 else ("plain", 0)
        if not rule.forced:
            rule.rate *= rate_scale
        drafts, last = 0, len(data["prompt"]) - 1
        while True:
            keep, more = rule.add(float(data["draft_conf"][min(i + drafts, last)]))
            if not keep:
                if drafts:
                    state["dropped"] = True  # the step that drafted it ran: replay charges it
                    return "draft", drafts
                return "dropped", int(bool(spare) or prices.min_rows >= 2)  # the step ran; its draft is not verified
            drafts += 1
            if not more or i + drafts > last or data["prompt"][i + drafts] != data["prompt"][i]:
                return "draft", drafts

    return policy


def _guess_pays(costs: CostModel, rate: float) -> bool:
    """Whether a draft-less round's guess (right with chance ``rate``) is worth a second row: (1 + rate)
    tokens in a two-row pass against one token in a one-row pass."""
    return rate > 0 and (1 + rate) / costs.expected_cost(0, 0, 0, spare=rate) > 1 / costs.expected_cost(0, 0, 0)


def load_signals(paths: list[Path]) -> dict[str, np.ndarray]:
    """One or more signals files as one set of answers (each file's prompts numbered apart, so that the
    replay keeps every answer to itself): several seeds of sampled answers make a category's figures
    depend less on which answers one seed happened to draw."""
    parts = [dict(np.load(path)) for path in paths]
    for k, part in enumerate(parts):
        part["prompt"] = part["prompt"] + k * (1 + max(int(p["prompt"].max()) for p in parts))
    shared = [name for name in parts[0] if all(name in part for part in parts)]  # older files lack newer fields
    return {name: np.concatenate([part[name] for part in parts]) for name in shared}


def analyze(
    paths: list[Path],
    bench_json: Path,
    machine: str | None = None,
    one_row: bool = False,
    gamma_max: int = ChainConfig.gamma,
    warm_up: list[Path] = (),
    warm_up_category: str | None = None,
    learn_drops: bool = True,
    rate_scale: float = 1.0,
    orders: int = 1,
    drafter_ms: float | None = None,
) -> None:
    data = load_signals(paths)
    prices = Prices.of_machine(machine) if machine else Prices.measured(bench_json)
    prices.min_rows = 1 if one_row else 2
    if drafter_ms is not None:
        prices = prices.with_drafter(drafter_ms / 1e3)
    start = {
        lookup: warmed_calibration(warm_up, warm_up_category, prices, lookup, gamma_max, learn_drops)
        for lookup in (False, True)
    }
    schedule = lambda lookup, answers=data: adaptive_policy(
        answers, prices, lookup, gamma_max, start[lookup], learn_drops, rate_scale
    )
    print(
        f"prices (ms): target { ({n: round(1e3 * t, 1) for n, t in sorted(prices.target.items())}) }, drafter "
        f"{ ({n: round(1e3 * t, 1) for n, t in sorted(prices.draft.items())}) }, head {1e3 * prices.head:.2f}, "
        f"outside ORT per round {1e3 * prices.outside:.2f}"
    )
    print(
        f"{len(data['prompt'])} positions; drafter accepted {data['draft_ok'].mean():.3f}, "
        f"free guess {data['guess_ok'].mean():.3f}, lookup available {(data['lookup_len'] > 0).mean():.3f}"
    )
    accepted = data["draft_ok"].astype(bool)
    same_prompt = np.r_[False, data["prompt"][1:] == data["prompt"][:-1]]
    previous_ok = np.where(same_prompt, np.r_[True, accepted[:-1]], True).astype(float)
    signals = {
        "drafter confidence (costs the step)": data["draft_conf"],
        "target top-p of the pending token": data["target_top"],
        "target margin top1-top2": data["target_margin"],
        "minus target entropy": -data["target_entropy"],
        "previous position accepted": previous_ok,
        "n-gram match length": data["guess_match"].astype(float),
    }
    if "pending_q" in data:  # the drafter's probability of the token the round starts from (known before its step)
        signals["drafter's probability of the pending token"] = data["pending_q"]
    for name, score in signals.items():
        print(f"AUC for 'draft accepted', {name}: {auc(score, accepted):.3f}")
    after_miss = same_prompt & (previous_ok == 0)  # the rounds that start from a target's correction
    if "pending_q" in data and 0 < accepted[after_miss].mean() < 1:
        print(
            f"  after a rejected draft ({after_miss.sum()} positions): drafter confidence "
            f"{auc(data['draft_conf'][after_miss], accepted[after_miss]):.3f}, drafter's probability of the "
            f"pending token {auc(data['pending_q'][after_miss], accepted[after_miss]):.3f}"
        )
    with_lookup = lambda i, state: ("lookup", 1) if data["lookup_len"][i] else ("draft", 1)
    skip_unsure = lambda i, state: ("guess", 1) if data["target_top"][i] < 0.3 else ("draft", 1)
    long_lookup = lambda i, state: ("lookup", 2) if data["lookup_match"][i] >= 4 else ("draft", 1)

    def extend_when_sure(i: int, state: dict, sure: float = 0.95) -> Choice:
        """Prescient: up to three drafts while the drafter's confidence in each (known before drafting
        it only here) stays above ``sure``."""
        drafts = 1
        while (
            drafts < 3
            and i + drafts < len(data["prompt"])
            and data["prompt"][i + drafts] == data["prompt"][i]
            and min(data["draft_conf"][i + drafts - 1], data["draft_conf"][i + drafts]) >= sure
        ):
            drafts += 1
        return "draft", drafts

    sweep = sorted({g for g in (1, 2, 3, 4, 6, 8) if g <= gamma_max} | {gamma_max})  # as the bench sweeps
    policies = {f"fixed γ={g}": fixed_gamma(g) for g in sweep}
    policies.update(
        {
            "fixed γ=1 + lookup": with_lookup,
            "adaptive (runtime schedule)": schedule(lookup=False),
            "adaptive + lookup (runtime default)": schedule(lookup=True),
            "skip when target top-p < 0.3": skip_unsure,
            "lookup (γ=2) only on 4-token matches": long_lookup,
            "prescient: skip when drafter conf < 0.4": lambda i, state: (
                ("guess", 1) if data["draft_conf"][i] < 0.4 else ("draft", 1)
            ),
            "prescient: extend while drafter conf ≥ .95": extend_when_sure,
        }
    )
    results = {name: replay(data, prices, policy) for name, policy in policies.items()}
    results["foresight: every confidence known"] = replay(data, prices, foresight_policy(data, prices, gamma_max))
    results["oracle (every outcome known)"] = oracle(data, prices, gamma_max)
    base = results["fixed γ=1"]
    categories = sorted(base)
    print(f"{'policy':40s} {'overall':>8s} " + " ".join(f"{c[:8]:>8s}" for c in categories))
    for name, result in results.items():
        overall = _rate(result, [c for c in categories if c != "low-acceptance"]) / _rate(
            base, [c for c in categories if c != "low-acceptance"]
        )
        cells = " ".join(f"{_rate(result, [c]) / _rate(base, [c]):8.3f}" for c in categories)
        print(f"{name:40s} {overall:8.3f} {cells}")
    print("(speed relative to fixed γ = 1; overall leaves the low-acceptance set out)")
    mixed = [c for c in categories if c != "low-acceptance"]
    oracle_gain = _rate(results["oracle (every outcome known)"], mixed) / _rate(base, mixed) - 1
    for name in (
        "adaptive (runtime schedule)",
        "adaptive + lookup (runtime default)",
        "foresight: every confidence known",
    ):
        gain = _rate(results[name], mixed) / _rate(base, mixed) - 1
        print(
            f"{name}: {gain / oracle_gain:.2f} of the oracle's gain over fixed γ = 1 "
            f"({100 * gain:+.1f}% against {100 * oracle_gain:+.1f}%)"
        )
    told = {what: informed_policy(data, schedule(lookup=True), know, gamma_max) for know, what in KNOWLEDGE.items()}
    told["every draft's confidence of a round before its steps"] = peeking_policy(data, prices, gamma_max, start[True])
    for what, policy in told.items():  # where the rest of the oracle's gain lies
        gain = _rate(replay(data, prices, policy), mixed) / _rate(base, mixed) - 1
        print(f"  the default told {what}: {gain / oracle_gain:.2f} of the oracle's gain ({100 * gain:+.1f}%)")
    fixed = [results[f"fixed γ={g}"] for g in sweep]
    for name in ("adaptive (runtime schedule)", "adaptive + lookup (runtime default)"):
        overall, worst, where = against_best_fixed(results[name], fixed)
        print(
            f"{name}: {overall:.3f}x the best single fixed γ overall; worst category {where} "
            f"{worst:.3f}x its best fixed γ"
        )
    if orders > 1:
        order_spread(data, prices, sweep, orders, schedule)


def fixed_gamma(gamma: int) -> Callable[[int, dict], Choice]:
    """The policy that drafts ``gamma`` drafts every round."""
    return lambda i, state: ("draft", gamma)


def against_best_fixed(
    result: dict[str, tuple[float, int]], fixed: list[dict[str, tuple[float, int]]]
) -> tuple[float, float, str]:
    """``result`` against the best of the ``fixed`` γ replays: overall (the low-acceptance set left out),
    and in its worst category against that category's best (ratio, category)."""
    categories = sorted(result)
    mixed = [c for c in categories if c != "low-acceptance"]
    overall = _rate(result, mixed) / max(_rate(f, mixed) for f in fixed)
    worst, where = min((_rate(result, [c]) / max(_rate(f, [c]) for f in fixed), c) for c in categories)
    return overall, worst, where


def shuffled(data: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The same answers met in another order: prompts renumbered by a seeded permutation (the replay
    walks them by number, and the calibration it carries from one answer to the next meets them so)."""
    numbers = np.unique(data["prompt"])
    renumber = dict(zip(numbers, np.random.default_rng(seed).permutation(len(numbers))))
    return {**data, "prompt": np.array([renumber[p] for p in data["prompt"]])}


def order_spread(
    data: dict[str, np.ndarray],
    prices: Prices,
    sweep: list[int],
    orders: int,
    schedule: Callable[..., Callable[[int, dict], Choice]],
) -> None:
    """The schedule (``schedule(lookup, answers)``, with and without lookup) against the best single fixed
    γ of ``sweep``, overall and in its worst category, over ``orders`` orders of the answers (the file's
    own, then seeded shuffles): the carried calibration makes a category's figure depend on which answers
    came before it."""
    rows: dict[bool, list[tuple[float, float, str]]] = {False: [], True: []}
    for k in range(orders):
        order = data if k == 0 else shuffled(data, k)
        fixed = [replay(order, prices, fixed_gamma(g)) for g in sweep]
        for lookup in rows:
            rows[lookup].append(against_best_fixed(replay(order, prices, schedule(lookup, order)), fixed))
    for lookup, name in ((False, "adaptive (runtime schedule)"), (True, "adaptive + lookup (runtime default)")):
        overall, worst, where = zip(*rows[lookup])
        print(
            f"{name}, {orders} orders: {np.mean(overall):.3f}x the best single fixed γ overall (lowest "
            f"{min(overall):.3f}); worst category {np.mean(worst):.3f}x its best fixed γ (lowest {min(worst):.3f}, "
            f"{where[int(np.argmin(worst))]})"
        )


def warmed_calibration(
    paths: list[Path], category: str | None, prices: Prices, lookup: bool, gamma_max: int, learn_drops: bool = True
) -> AcceptanceCalibration | None:
    """The calibration the schedule carries out of replaying ``paths`` (only their ``category`` answers,
    if given): the state a user's earlier requests leave, which the engine keeps across requests and
    processes.  None without ``paths`` (a fresh calibration)."""
    if not paths:
        return None
    warm = load_signals(paths)
    if category is not None:
        keep = warm["category"] == category
        if not keep.any():
            raise SystemExit(f"--warm-up-category {category!r}: no such answers in the warm-up files")
        warm = {name: values[keep] for name, values in warm.items()}
    calibration = AcceptanceCalibration()
    replay(warm, prices, adaptive_policy(warm, prices, lookup, gamma_max, calibration, learn_drops))
    return calibration


def signal_value(train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> None:
    """Does any signal the runtime could read add to the drafter's confidence?  Logistic models of
    'draft accepted' fitted on ``train`` (Newton's method) and scored on ``test`` (held-out log-loss and
    AUC): the confidence's log-odds alone; with the target's top-p, margin and entropy at the pending
    token and the previous position's outcome; with the drafter's second probability and entropy; and
    with the drafter's whole hidden state, a linear probe as SpecDec++ trains one (standardized, at a few
    ridge strengths; files recorded before these fields existed skip the models that need them)."""
    odds = _log_odds

    def target_side(data: dict[str, np.ndarray]) -> list[np.ndarray]:
        same = np.r_[False, data["prompt"][1:] == data["prompt"][:-1]]
        previous = np.where(same, np.r_[1.0, data["draft_ok"][:-1].astype(float)], 0.5)
        return [odds(data["target_top"]), data["target_margin"], -data["target_entropy"], previous - 0.5]

    drafter_side = lambda data: [np.log(np.clip(data["draft_second"], 1e-6, 1)), data["draft_entropy"]]
    hidden = lambda data: list(data["draft_hidden"].astype(np.float64).T)
    models = {
        "drafter confidence": ([], (), 0.0),
        "drafter confidence + target top-p, margin, entropy, previous outcome": ([target_side], (), 0.0),
        "drafter confidence + its second probability and entropy": ([drafter_side], ("draft_second",), 0.0),
    }
    for ridge in (0.003, 0.03, 0.3):
        models[f"drafter confidence + its hidden state (ridge {ridge})"] = (
            [drafter_side, hidden],
            ("draft_hidden",),
            ridge,
        )
    for name, (parts, needs, ridge) in models.items():
        if any(field not in train or field not in test for field in needs):
            continue
        columns = lambda data: np.stack([odds(data["draft_conf"])] + [c for part in parts for c in part(data)], axis=1)
        loss, score = _held_out(
            columns(train), train["draft_ok"].astype(float), columns(test), test["draft_ok"].astype(bool), ridge
        )
        print(f"held-out 'draft accepted' from {name}: log-loss {loss:.4f}, AUC {score:.3f}")
    before_the_step(train, test)


def _held_out(x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray, ridge: float) -> tuple[float, float]:
    """(log-loss, AUC) on ``xt, yt`` of a logistic model of ``y`` fitted on ``x`` (see :func:`_fit_logistic`)."""
    weights, bias, mean, scale = _fit_logistic(x, y, ridge)
    score = ((xt - mean) / scale) @ weights + bias
    p = np.clip(1 / (1 + np.exp(-score)), 1e-9, 1 - 1e-9)
    return float(-np.mean(np.where(yt, np.log(p), np.log(1 - p)))), auc(score, yt)


def _followed(data: dict[str, np.ndarray], accepted: bool) -> np.ndarray:
    """Positions j whose draft was accepted (``accepted``; else rejected) and whose answer goes on: the draft
    at j + 1 is then a later draft of a round that could continue past j, or the first draft of a round
    whose pending token is the target's correction at j."""
    same = np.r_[data["prompt"][1:] == data["prompt"][:-1], False]
    return np.flatnonzero(same & (data["draft_ok"].astype(bool) == accepted))


def _log_odds(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def before_the_step(train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> None:
    """What a schedule can know of a draft before it pays the drafter step that makes it.  The oracle's gain
    lies mostly in where a chain of accepted drafts breaks (``informed_policy``); a schedule that learns each
    draft's confidence only by paying its step sees, when it decides whether to take that step, the drafts
    before it.  Held-out models of 'the next draft is accepted' (a later draft, its predecessor accepted):
    from the previous draft's confidence (what the schedule's table of later drafts reads), with the
    previous step's hidden state (a linear probe, the most a step already paid for can tell), against the
    next draft's own confidence, which only its step reveals (what the foresight bound is given).  The same
    for a round's first draft after a rejection, from what the target's correction tells before the step.  A
    schedule could only pass the foresight bound with a model before the step better than the last of each."""
    odds = _log_odds
    previous = lambda data, at: [odds(data["draft_conf"][at])]
    probe = lambda data, at: previous(data, at) + list(data["draft_hidden"][at].astype(np.float64).T)
    revealed = lambda data, at: [odds(data["draft_conf"][at + 1])]
    models = {
        "the previous draft's confidence": (previous, (), 0.0),
        "the previous draft's confidence and hidden state (ridge 0.3)": (probe, ("draft_hidden",), 0.3),
        "its own confidence, which its step reveals": (revealed, (), 0.0),
    }
    target = lambda data, at: [
        odds(data["target_top"][at + 1]),
        data["target_margin"][at + 1],
        -data["target_entropy"][at + 1],
    ]
    pending = lambda data, at: target(data, at) + [odds(data["pending_q"][at + 1])]
    first = {
        "the target's top-p, margin and entropy at the correction": (target, (), 0.0),
        "those and the drafter's probability of the correction": (pending, ("pending_q",), 0.0),
        "its own confidence, which its step reveals": (revealed, (), 0.0),
    }
    for what, after_accepted, kinds in (
        ("next draft accepted", True, models),
        ("first draft after a rejection accepted", False, first),
    ):
        at, test_at = _followed(train, after_accepted), _followed(test, after_accepted)
        y, yt = train["draft_ok"][at + 1].astype(float), test["draft_ok"][test_at + 1].astype(bool)
        for name, (columns, needs, ridge) in kinds.items():
            if any(field not in train or field not in test for field in needs):
                continue
            loss, score = _held_out(
                np.stack(columns(train, at), axis=1), y, np.stack(columns(test, test_at), axis=1), yt, ridge
            )
            print(f"held-out '{what}' (before its step) from {name}: log-loss {loss:.4f}, AUC {score:.3f}")


def prompt_halves(data: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The answers to even-numbered prompts and those to odd-numbered ones: a held-out split of one file
    in which no answer is on both sides."""
    even = data["prompt"] % 2 == 0
    return {k: v[even] for k, v in data.items()}, {k: v[~even] for k, v in data.items()}


def _fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Logistic regression on standardized columns by Newton's method, with ``ridge`` times the squared
    weights (not the bias) added to the mean log-loss."""
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-9
    z = np.c_[np.ones(len(x)), (x - mean) / scale]
    penalty = 2 * ridge * len(x) * np.diag(np.r_[0.0, np.ones(x.shape[1])]) + 1e-6 * np.eye(z.shape[1])
    w = np.zeros(z.shape[1])
    for _ in range(30):
        p = 1 / (1 + np.exp(-z @ w))
        step = np.linalg.solve((z * (p * (1 - p))[:, None]).T @ z + penalty, z.T @ (p - y) + penalty @ w)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w[1:], float(w[0]), mean, scale


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    pos, neg = np.sort(score[positive]), np.sort(score[~positive])
    below = np.searchsorted(neg, pos, side="left")
    ties = np.searchsorted(neg, pos, side="right") - below
    return float((below + 0.5 * ties).sum() / (len(pos) * len(neg)))


def _rate(result: dict[str, tuple[float, int]], categories: list[str]) -> float:
    return sum(result[c][1] for c in categories) / sum(result[c][0] for c in categories)
