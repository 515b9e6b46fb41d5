"""Multi-turn rollouts (pfppo_mega/rollout/multiturn.py): the loop on a scripted engine (what each
row's response, mask and log-probs become; tools and a simulated user; the limits and the budget),
the config section and verl's keys."""

from __future__ import annotations

import threading

import pytest
import torch

from pfppo_mega.data.chat import ChatTemplate
from pfppo_mega.data.examples import train_bpe_tokenizer
from pfppo_mega.rollout.base import RolloutOutput, SamplingParams
from pfppo_mega.rollout.multiturn import (MultiTurnRollout, ToolSet, TurnLimits, TurnTokens, raw_text,
                                          truncate_text)
from pfppo_mega.rollout.tools.base import InteractionTurn, ToolResult
from pfppo_mega.types import Sample

# A ChatML-like template: an assistant turn ends with EOS and a newline; tool answers go in a user
# block, as Qwen2.5's template writes them.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}"
            "</tool_response>{{ eos_token }}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXTS = ['<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>', "The answer is 5.",
         "<tool_response>5</tool_response>", "What is 2+3?", "wrong, try again", "Error: tool"] * 20


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(TEMPLATE, special_tokens={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                        where="test")


class Calc:
    """Evaluates "a+b" for the row it was created for; records its lifecycle."""

    name = "calc"
    schema = {"type": "function", "function": {"name": "calc", "description": "add", "parameters": {}}}

    def __init__(self, reward: float = 0.5) -> None:
        self.created, self.released, self.calls = {}, [], []
        self.reward = reward
        self.lock = threading.Lock()

    def create(self, instance_id, **kw):
        self.created[instance_id] = kw

    def execute(self, instance_id, arguments):
        with self.lock:
            self.calls.append((instance_id, arguments))
        a, b = str(arguments["expr"]).split("+")
        return ToolResult(str(int(a) + int(b)), reward=self.reward, metrics={"ok": 1.0})

    def release(self, instance_id):
        self.released.append(instance_id)


class Teacher:
    """Says "wrong, try again" once, then ends the conversation."""

    name = "teacher"

    def __init__(self) -> None:
        self.turns, self.started, self.finished, self.seen = {}, {}, [], []

    def start(self, instance_id, **kw):
        self.started[instance_id] = kw
        self.turns[instance_id] = 0

    def respond(self, instance_id, messages):
        self.seen.append([m["role"] for m in messages])
        self.turns[instance_id] += 1
        if self.turns[instance_id] == 1:
            return InteractionTurn(False, "wrong, try again", score=0.0)
        return InteractionTurn(True, score=1.0)

    def finish(self, instance_id):
        self.finished.append(instance_id)


class Scripted:
    """An engine that answers row r's k-th policy turn with script[r][k] (+ EOS), cut at
    max_new_tokens; log-probs -0.01 * (position + 1). Rows are recognised by their prompt."""

    def __init__(self, tok, prompts, scripts, eos=True):
        self.tok, self.prompts, self.scripts, self.eos = tok, [list(p) for p in prompts], scripts, eos
        self.calls = []

    def __call__(self, prompts, params):
        self.calls.append((len(prompts), params.max_new_tokens, params.seed))
        B = len(prompts)
        outs = []
        for p in prompts:
            r = next(i for i, q in enumerate(self.prompts) if p[:len(q)] == q)
            k = sum(1 for t in p[len(self.prompts[r]):] if t == self.tok.eos_id) // 1
            k = self._turn(p[len(self.prompts[r]):])
            ids = self.tok.encode(self.scripts[r][min(k, len(self.scripts[r]) - 1)], add_bos=False)
            ids = (ids + [self.tok.eos_id] if self.eos else ids)[: params.max_new_tokens]
            outs.append(ids)
        T = max((len(o) for o in outs), default=0)
        resp = torch.full((B, T), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros(B, T)
        lp = torch.zeros(B, T)
        for i, o in enumerate(outs):
            resp[i, :len(o)] = torch.tensor(o, dtype=torch.long)
            mask[i, :len(o)] = 1
            lp[i, :len(o)] = -0.01 * torch.arange(1, len(o) + 1)
        return RolloutOutput(prompts=prompts, responses=resp, response_mask=mask, logprobs=lp,
                             lengths=torch.tensor([len(o) for o in outs], dtype=torch.long),
                             finished=torch.tensor([bool(o) and o[-1] == self.tok.eos_id for o in outs]),
                             weight_version=3)

    def _turn(self, response):
        """Policy turns completed so far: EOS tokens the policy wrote (a tool block's EOS follows a
        <|user|> marker; count only EOS tokens not inside a user block)."""
        user = self.tok.hf.token_to_id("<|user|>")
        assistant = self.tok.hf.token_to_id("<|assistant|>")
        turns, in_user = 0, False
        for t in response:
            if t == user:
                in_user = True
            elif t == assistant:
                in_user = False
            elif t == self.tok.eos_id and not in_user:
                turns += 1
        return turns


def _sample(tok, template, q, extra=None, i=0):
    messages = ({"role": "user", "content": q},)
    text = template.render(list(messages), add_generation_prompt=True)
    return Sample(prompt_ids=tuple(tok.encode(text)), data_source="test", ground_truth="5",
                  extra_info=dict(extra or {}), prompt_text=text, row=f"test:{i}", messages=messages)


CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=64, eos_token_id=None, seed=11)


def _run(tok, template, samples, scripts, *, tools=None, interactions=None, budget=80, limits=TurnLimits(),
         context=200, eos=True, agree=None, log=None):
    engine = Scripted(tok, [s.prompt_ids for s in samples], scripts, eos=eos)
    toolset = ToolSet(tools or {}, interactions or {})
    kw = {} if agree is None else {"agree": agree}
    loop = MultiTurnRollout(generate=engine, tokenizer=tok, turn_tokens=TurnTokens(template, tok),
                            toolset=toolset, limits=limits, max_response_length=budget, max_context=context,
                            log=log or (lambda *_: None), **kw)
    return loop.run(samples, PARAMS), engine


def test_a_tool_turn_is_appended_with_mask_zero_and_the_row_goes_on(tok, template):
    calc = Calc()
    samples = [_sample(tok, template, "What is 2+3?", {"tools_kwargs": {"calc": {"create_kwargs": {"gt": 5}}}}),
               _sample(tok, template, "What is 2+3? ", i=1)]
    res, engine = _run(tok, template, samples, [[CALL, "The answer is 5."], ["The answer is 5."]],
                       tools={"calc": calc})
    eos = tok.eos_id
    turn1 = tok.encode(CALL, add_bos=False) + [eos]
    tool = tok.encode("\n<|user|><tool_response>5</tool_response></s>\n<|assistant|>", add_bos=False)
    turn2 = tok.encode("The answer is 5.", add_bos=False) + [eos]
    want = turn1 + tool + turn2
    out = res.output
    assert out.responses[0, :len(want)].tolist() == want and int(out.lengths[0]) == len(want)
    assert out.response_mask[0, :len(want)].tolist() == [1.0] * len(turn1) + [0.0] * len(tool) + [1.0] * len(turn2)
    assert out.response_mask[0, len(want):].sum() == 0
    lp = out.logprobs[0]
    assert torch.all(lp[len(turn1):len(turn1) + len(tool)] == 0)
    torch.testing.assert_close(lp[:len(turn1)], -0.01 * torch.arange(1, len(turn1) + 1))
    torch.testing.assert_close(lp[len(turn1) + len(tool):len(want)], -0.01 * torch.arange(1, len(turn2) + 1))
    assert out.finished.tolist() == [True, True] and out.weight_version == 3
    # row 1 answered at once: one turn, nothing appended
    assert out.response_mask[1].tolist()[: int(out.lengths[1])] == [1.0] * len(turn2)
    # the tool's lifecycle: both rows got an instance (row 0 with its kwargs), each released when its row
    # ended (row 1 after the first call, row 0 after the second)
    assert calc.created == {"r0-calc": {"gt": 5}, "r1-calc": {}} and calc.released == ["r1-calc", "r0-calc"]
    assert calc.calls == [("r0-calc", {"expr": "2+3"})]
    assert res.extra[0]["tool_rewards"] == 0.5 and res.extra[1]["tool_rewards"] == 0.0
    assert res.extra[0]["turns"] == 2 and res.extra[0]["tool_calls"] == 1
    assert res.texts[0].startswith(CALL) and res.texts[0].endswith("The answer is 5.") and "5</tool_response>" in res.texts[0]
    m = res.stats.metrics()
    assert m["rollout/turns_mean"] == 1.5 and m["rollout/turns_max"] == 2 and m["rollout/tool_calls_mean"] == 0.5
    assert m["tool/calc/calls"] == 1 and m["tool/calc/ok"] == 1.0 and m["rollout/tool_call_errors"] == 0
    assert m["rollout/tool_tokens_frac"] == pytest.approx(len(tool) / (len(want) + len(turn2)))
    assert m["rollout/tokenization_mismatches"] == 0
    # two engine calls: both rows, then row 0 alone; each call seeded anew
    assert [c[0] for c in engine.calls] == [2, 1] and engine.calls[0][2] != engine.calls[1][2]


def test_the_turn_tokens_are_the_templates_difference(tok, template):
    tt = TurnTokens(template, tok)
    ids = tt.ids([{"role": "tool", "content": "42"}])
    assert raw_text(tok, ids) == "\n<|user|><tool_response>42</tool_response></s>\n<|assistant|>"
    ids = tt.ids([{"role": "user", "content": "again"}])
    assert raw_text(tok, ids) == "\n<|user|>again</s>\n<|assistant|>"


def test_an_interaction_replies_once_then_ends(tok, template):
    teacher = Teacher()
    s = _sample(tok, template, "What is 2+3?", {"interaction_kwargs": {"name": "teacher", "ground_truth": "5"}})
    res, _ = _run(tok, template, [s], [["The answer is 4.", "The answer is 5."]], interactions={"teacher": teacher})
    reply = tok.encode("\n<|user|>wrong, try again</s>\n<|assistant|>", add_bos=False)
    t1 = tok.encode("The answer is 4.", add_bos=False) + [tok.eos_id]
    t2 = tok.encode("The answer is 5.", add_bos=False) + [tok.eos_id]
    n = int(res.output.lengths[0])
    assert res.output.responses[0, :n].tolist() == t1 + reply + t2
    assert res.output.response_mask[0, :n].tolist() == [1.0] * len(t1) + [0.0] * len(reply) + [1.0] * len(t2)
    assert teacher.started == {"r0-teacher": {"ground_truth": "5"}} and teacher.finished == ["r0-teacher"]
    assert teacher.seen == [["user", "assistant"], ["user", "assistant", "user", "assistant"]]
    assert res.extra[0]["interaction_scores"] == [0.0, 1.0] and res.extra[0]["turns"] == 2


def test_limits_end_the_row(tok, template):
    calc = Calc()
    s = _sample(tok, template, "What is 2+3?")
    res, _ = _run(tok, template, [s], [[CALL, CALL, CALL, "done"]], tools={"calc": calc},
                  limits=TurnLimits(max_assistant_turns=2), budget=300, context=400)
    assert res.extra[0]["turns"] == 2 and len(calc.calls) == 1 and bool(res.output.finished[0])
    res, _ = _run(tok, template, [s], [[CALL, CALL, CALL, "done"]], tools={"calc": Calc()},
                  limits=TurnLimits(max_user_turns=1), budget=300, context=400)
    assert res.extra[0]["turns"] == 2 and res.extra[0]["tool_calls"] == 1


def test_the_budget_counts_tool_tokens_and_a_cut_row_is_unfinished(tok, template):
    s = _sample(tok, template, "What is 2+3?")
    t1 = len(tok.encode(CALL, add_bos=False)) + 1
    tool = len(tok.encode("\n<|user|><tool_response>5</tool_response></s>\n<|assistant|>", add_bos=False))
    # room for turn 1 and the answer, 3 more tokens: turn 2 is cut
    res, engine = _run(tok, template, [s], [[CALL, "The answer is 5."]], tools={"calc": Calc()},
                       budget=t1 + tool + 3)
    assert int(res.output.lengths[0]) == t1 + tool + 3 and not bool(res.output.finished[0])
    assert engine.calls[1][1] == 3  # the second call asked for the budget left
    # no room for the answer and one more policy token: the answer is not appended, the row ends cut
    res, _ = _run(tok, template, [s], [[CALL, "x"]], tools={"calc": Calc()}, budget=t1 + tool)
    assert int(res.output.lengths[0]) == t1 and res.output.response_mask[0, :t1].all()
    assert not bool(res.output.finished[0]) and res.stats.metrics()["rollout/cut_before_answer"] == 1


def test_a_turn_capped_by_another_rows_context_goes_on_in_the_next_call(tok, template):
    long_q = "What is 2+3? " * 3
    a, b = _sample(tok, template, "What is 2+3?"), _sample(tok, template, long_q, i=1)
    answer = "The answer is 5. The answer is 5."
    n = len(tok.encode(answer, add_bos=False)) + 1
    context = len(b.prompt_ids) + 4  # row b may take 4 tokens per call
    res, engine = _run(tok, template, [a, b], [[answer], [answer]], context=context + 100, budget=n)
    whole = res.output.responses[1, :n].tolist()
    res2, engine2 = _run(tok, template, [a, b], [[answer], [answer]], context=context, budget=n)
    # the scripted engine restarts its script for a continued turn, so compare the first call only
    assert engine2.calls[0][1] == 4 and len(engine2.calls) > 1
    assert res2.output.response_mask[1, :int(res2.output.lengths[1])].all()
    assert whole[:4] == res2.output.responses[1, :4].tolist()


def test_every_rank_makes_the_same_calls(tok, template):
    """With a rollout split the engine call is collective: a rank whose rows are done still calls
    (with no prompts) while another rank's rows go on, asking the job's max_new_tokens."""
    s = _sample(tok, template, "What is 2+3?")
    others = iter([1, 1, 1, 0])  # the other rank has a row generating for three calls, 7 tokens of budget
    res, engine = _run(tok, template, [s], [["done"]],
                       agree=lambda n, rem, room: (max(n, next(others)), max(rem, 7), room))
    assert [c[0] for c in engine.calls] == [1, 0, 0] and [c[1] for c in engine.calls] == [80, 7, 7]
    assert res.extra[0]["turns"] == 1


@pytest.mark.parametrize("side, want", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                        ("middle", "ab...(truncated)...ij")])
def test_tool_answers_are_cut_as_verl_cuts_them(side, want):
    assert truncate_text("abcdefghij", 4, side) == want and truncate_text("abc", 4, side) == "abc"


def test_a_long_tool_answer_reaches_the_policy_cut(tok, template):
    class Long(Calc):
        def execute(self, instance_id, arguments):
            return ToolResult("1234567890" * 5)

    s = _sample(tok, template, "What is 2+3?")
    res, _ = _run(tok, template, [s], [[CALL, "ok"]], tools={"calc": Long()},
                  limits=TurnLimits(max_tool_response_length=6, truncate_side="left"))
    assert "<tool_response>123456...(truncated)</tool_response>" in res.texts[0]


# ----------------------------------------------------------------------------- downstream of a gapped mask

def _gapped(B=4, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    mask[0, :3], mask[0, 6:9] = 1, 1          # turn, tool tokens, turn, padding
    mask[1, :T] = 1                           # one turn filling the row
    mask[2, :2], mask[2, 4:5], mask[2, 7:10] = 1, 1, 1  # three turns
    mask[3, :5] = 1                           # single-turn (a prefix)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, values, mask


def _gae_reference(rewards, values, mask, gamma, lam):
    """GAE over each row's mask-1 tokens only, one token at a time: the tokens the policy did not
    write are removed, the rest is the textbook recursion (what verl 0.9.1's gap-skipping computes)."""
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t] > 0]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[b, t]) + gamma * nxt_v - float(values[b, t])
            a = delta + gamma * lam * nxt_a
            adv[b, t] = a
            nxt_v, nxt_a = float(values[b, t]), a
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_skips_the_tool_tokens_as_verl_does(gamma, lam):
    from pfppo_mega.ppo import compute_gae

    rewards, values, mask = _gapped()
    adv, ret = compute_gae(rewards, values, mask.double(), gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-12)
    # the gaps matter: cutting the rows at the gap (the old recursion) gives other advantages
    cut = mask.clone()
    cut[0, 6:] = 0
    assert not torch.allclose(compute_gae(rewards, values, cut.double(), gamma=gamma, lam=lam)[0][0, :3], adv[0, :3])


def test_the_fused_gae_skips_the_gaps_of_a_mask():
    """The kernel scans the compacted rows (ops.gae): equal to the gap-skipping reference."""
    from pfppo_mega.kernels.backends import FusedBackend, fused_available

    if not fused_available("cpu"):
        print("SKIP reason: the fused CPU kernels are not built here (pfppo_mega/_C)")
        pytest.skip("fused CPU kernels not built")
    rewards, values, mask = _gapped()
    fused = FusedBackend()
    for whiten in (False, True):
        adv, ret = fused.gae(rewards.float(), values.float(), mask, gamma=1.0, lam=0.95, whiten=whiten)
        ref_adv, ref_ret = _gae_reference(rewards, values, mask, 1.0, 0.95)
        if whiten:
            from pfppo_mega.ppo import masked_whiten
            ref_adv = masked_whiten(ref_adv, mask.double())
        torch.testing.assert_close(adv.double(), ref_adv * mask, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-4, atol=1e-4)
    # a prefix mask still runs the kernel (same result as the reference there)
    prefix = torch.zeros_like(mask)
    prefix[:, :5] = 1
    adv, _ = fused.gae(rewards.float(), values.float(), prefix, gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv.double(), _gae_reference(rewards, values, prefix, 1.0, 0.95)[0], rtol=1e-4, atol=1e-4)


def test_extent_and_pack_keep_the_tool_tokens_inside_a_row():
    from pfppo_mega.types import pack, response_extent

    _, _, mask = _gapped()
    assert response_extent(mask).tolist() == [9, 12, 10, 5]
    responses = torch.arange(48).reshape(4, 12) + 100
    inp = pack([[1, 2], [3], [4, 5, 6], [7]], responses, mask, pad_id=0)
    assert inp.input_ids[0, :11].tolist() == [1, 2] + list(range(100, 109))     # tool tokens in the context
    assert int(inp.attention_mask[0].sum()) == 11
    assert inp.labels[0, 3:6].tolist() == [0, 0, 0]                             # ... but never a label
    assert inp.resp_pos[0, 6].item() == 2 - 1 + 6                                # turn 2's logits position


def test_the_policy_loss_gives_tool_tokens_no_gradient():
    """The loss on a gapped mask equals the loss over the policy's tokens alone (a reference written
    token by token), and its gradient is 0 on the tool tokens."""
    from pfppo_mega.ppo import policy_loss

    g = torch.Generator().manual_seed(1)
    _, _, mask = _gapped()
    B, T = mask.shape
    logp = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask.double(), clip_ratio_low=0.2, clip_ratio_high=0.2)
    out.loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0) and torch.all(logp.grad[mask == 1] != 0)
    terms = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                ratio = torch.exp(logp[b, t].detach() - old[b, t])
                terms.append(torch.maximum(-adv[b, t] * ratio, -adv[b, t] * ratio.clamp(0.8, 1.2)))
    torch.testing.assert_close(out.loss.detach(), torch.stack(terms).mean(), rtol=1e-10, atol=1e-12)


def test_verl_multi_turn_keys_map_to_ours():
    from pfppo_mega.config import resolve_config_dict

    r = "actor_rollout_ref.rollout.multi_turn"
    cfg = resolve_config_dict({}, [f"{r}.enable=True", f"{r}.max_assistant_turns=5", f"{r}.max_user_turns=0",
                                   f"{r}.tool_config_path=tools.yaml", f"{r}.interaction_config_path=inter.yaml",
                                   f"{r}.max_parallel_calls=2", f"{r}.max_tool_response_length=100",
                                   f"{r}.tool_response_truncate_side=left",
                                   f"{r}.tokenization_sanity_check_mode=disable", f"{r}.format=hermes",
                                   f"{r}.num_repeat_rollouts=3", f"{r}.use_inference_chat_template=False",
                                   "data.tool_config_path=tools.yaml", "data.train_files=[a.parquet]",
                                   "actor_rollout_ref.model.path=/m"]).config
    mt = cfg.actor_rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.tool_config_path, mt.interaction_config_path,
            mt.max_parallel_calls, mt.max_tool_response_length, mt.tool_response_truncate_side,
            mt.tokenization_sanity_check_mode, mt.format) == (True, 5, None, "tools.yaml", "inter.yaml", 2, 100,
                                                               "left", "disable", "hermes")
    assert TurnLimits.from_config(mt) == TurnLimits(5, None, 2, 100, "left", "disable")


def test_multi_turn_with_the_rollout_split_on_two_ranks():
    """tests/multirank/multiturn_split.py under torchrun (2 gloo processes, one replica and one engine
    each): rank 0's row ends after one turn and its rank keeps making the collective calls, with no
    rows, while rank 1's row calls a tool and goes on; rank 1's second turn is generated by engine 0.
    Then one replica of both ranks: only its leader runs the tools. Every rank's rows equal a run
    without the split."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(here / "multirank" / "multiturn_split.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert r0["same_as_serial"] and r1["same_as_serial"]
    assert r0["turns"] == [1] and r1["turns"] == [2, 1] and r0["tool_calls"] == 0 and r1["tool_calls"] == 1
    # turn 1: 3 rows over 2 engines (engine 0: rank 0's row and rank 1's first, one call per replica;
    # engine 1: rank 1's second); turn 2: rank 1's first row alone, which engine 0 generates
    assert r0["engine_calls"] == [1, 1, 1] and r1["engine_calls"] == [1]
    assert 0.0 in r1["masks"][0] and r1["metrics"]["tool/calc/calls"] == 1
    # one replica of two ranks: only its leader creates and calls the tools; both ranks hold its rows
    a, b = r0["replica"], r1["replica"]
    assert a["same_as_serial"] and b["same_as_serial"] and a["turns"] == b["turns"] == [2, 1]
    assert (a["tool_calls"], a["created"]) == (1, 2) and (b["tool_calls"], b["created"]) == (0, 0)
    assert a["tool_rewards"] == b["tool_rewards"] == [0.5, 0.0] and a["metrics"] == b["metrics"]


@pytest.mark.parametrize("mode, counted", [("strict", 1), ("ignore_strippable", 1), ("disable", 0)])
def test_a_response_that_tokenizes_otherwise_as_one_text_is_counted(tok, template, mode, counted):
    """The policy may sample a token sequence that is not the tokenizer's own encoding of its text
    (here "The answer" spelt one character per token): re-tokenizing the conversation then differs."""
    s = _sample(tok, template, "What is 2+3?")
    engine = Scripted(tok, [s.prompt_ids], [["The answer is 5."]])
    spelt = [t for ch in "The answer is 5." for t in tok.encode(ch, add_bos=False)]
    assert spelt != tok.encode("The answer is 5.", add_bos=False)  # the case exists in this vocabulary

    def generate(prompts, params):
        out = engine(prompts, params)
        ids = spelt + [tok.eos_id]
        out.responses = torch.tensor([ids]); out.lengths = torch.tensor([len(ids)])
        out.response_mask = torch.ones(1, len(ids)); out.logprobs = torch.zeros(1, len(ids))
        return out

    logs = []
    loop = MultiTurnRollout(generate=generate, tokenizer=tok, turn_tokens=TurnTokens(template, tok), toolset=ToolSet(),
                            limits=TurnLimits(sanity_check=mode), max_response_length=80, max_context=200,
                            log=logs.append)
    res = loop.run([s], PARAMS)
    assert res.stats.metrics()["rollout/tokenization_mismatches"] == counted and len(logs) == counted
    assert res.texts == ["The answer is 5."]


def test_a_turns_parallel_calls_are_all_counted(tok, template):
    """A turn's calls run in threads; their counts and rewards are added in the loop's thread (a
    read-modify-write of a shared Counter from the workers loses updates when they interleave, which a
    slow Counter here makes certain)."""
    import time
    from collections import Counter

    class Slow(Counter):
        def __getitem__(self, key):
            value = super().__getitem__(key)
            time.sleep(0.02)  # another worker thread reads the same count meanwhile
            return value

    calc = Calc(reward=0.25)
    s = _sample(tok, template, "What is 2+3?")
    engine = Scripted(tok, [s.prompt_ids], [[CALL * 4, "The answer is 5."]])
    loop = MultiTurnRollout(generate=engine, tokenizer=tok, turn_tokens=TurnTokens(template, tok),
                            toolset=ToolSet({"calc": calc}), limits=TurnLimits(max_parallel_calls=4),
                            max_response_length=400, max_context=600, log=lambda *_: None)
    loop.counts = Slow()
    res = loop.run([s], PARAMS)
    assert len(calc.calls) == 4
    m = res.stats.metrics()
    assert m["tool/calc/calls"] == 4 and m["tool/calc/ok"] == 1.0 and res.extra[0]["tool_rewards"] == 1.0


def test_calls_are_read_when_the_tokenizer_makes_tool_call_a_special_token(tok, template):
    """Some checkpoints' tokenizers mark <tool_call> / </tool_call> special; the turn's text for the
    reward drops special tokens, so the calls are read from the text with them kept (as verl's parser)."""
    import copy

    special = copy.deepcopy(tok)
    special.hf.add_special_tokens(["<tool_call>", "</tool_call>"])
    assert special.decode(special.encode(CALL, add_bos=False)).startswith('{"name"')  # the markers are dropped
    calc = Calc()
    s = _sample(special, template, "What is 2+3?")
    res, _ = _run(special, template, [s], [[CALL, "The answer is 5."]], tools={"calc": calc})
    assert calc.calls == [("r0-calc", {"expr": "2+3"})] and res.extra[0]["turns"] == 2


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_returns_reach_the_turns_before_a_tool_answer(gamma):
    """REINFORCE++'s discounted return skips the tool tokens as GAE does: the outcome reward on the
    last policy token reaches the first turn (a reset at every mask-0 token gave it 0), discounted by
    the policy's tokens only; a prefix mask keeps the plain recursion."""
    from pfppo_mega.ppo.outcome import discounted_returns

    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    rewards = torch.zeros(2, 9, dtype=torch.float64)
    rewards[0, 6] = rewards[1, 3] = 1.0
    rewards[0, 1] = -0.5  # a per-token term (a KL penalty) on the first turn
    want = torch.zeros(2, 9, dtype=torch.float64)
    want[0, [6, 5, 1, 0]] = torch.tensor([1.0, gamma, gamma ** 2 - 0.5, gamma ** 3 - 0.5 * gamma], dtype=torch.float64)
    want[1, [3, 2, 1, 0]] = torch.tensor([1.0, gamma, gamma ** 2, gamma ** 3], dtype=torch.float64)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=gamma), want, rtol=0, atol=1e-12)


def test_the_multi_turn_counts_are_summed_over_the_data_parallel_ranks():
    """Each rank counts its own rows' tool calls, errors, cut rows...: the step's record holds the job's
    count (their sum), while the means (turns, tool tokens) stay means and turns_max a maximum."""
    from collections import Counter

    from pfppo_mega.rollout.multiturn import TurnStats
    from pfppo_mega.trainer.metrics import aggregate_rank_metrics

    ranks = [TurnStats(rows=2, turns=4, turns_max=3, tokens=10, policy_tokens=6, mismatches=1,
                       counts=Counter({"tool_calls": 3, "tool_call_errors": 1, "tool_calls_dropped": 2,
                                       "cut_before_answer": 1, "interaction_turns": 2, "tool/calc/calls": 2,
                                       "tool/calc/errors": 1, "tool/calc/ok": 2.0})),
             TurnStats(rows=2, turns=2, turns_max=1, tokens=10, policy_tokens=8, mismatches=0,
                       counts=Counter({"tool_calls": 1, "tool_call_errors": 0, "tool/calc/calls": 1,
                                       "tool/calc/ok": 1.0}))]
    out = aggregate_rank_metrics([r.metrics() for r in ranks])
    both = TurnStats()
    for r in ranks:
        both.add(r)
    one = both.metrics()  # the same rows counted on one rank
    for k in ("rollout/tool_call_errors", "rollout/tokenization_mismatches", "rollout/tool_calls_dropped",
              "rollout/cut_before_answer", "rollout/interaction_turns", "tool/calc/calls", "tool/calc/errors",
              "rollout/turns_mean", "rollout/turns_max", "rollout/tool_calls_mean", "rollout/tool_tokens_frac",
              "tool/calc/ok"):
        assert out[k] == pytest.approx(one[k]), k
