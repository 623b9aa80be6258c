"""lm-eval-harness's API models against the server (paged_attention/server/): ``local-completions``
for loglikelihoods and generations, ``local-chat-completions`` for generations, and a whole
multiple-choice task (tests/lm_eval_tasks/, no download), on SmolLM2-135M-Instruct in float32.
The oracle is the same weights without the server: transformers' float32 log-softmax with
sdpa attention, greedy decoding by full forward passes, and lm-eval's own ``hf`` model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.api_models import JsonChatStr  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from offline import refuse_remote_connections  # noqa: E402
from test_server import LiveServer, make_engine  # noqa: E402

from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402

MODEL = "smollm2"
TOLERANCE = 1e-3
ROOT = Path(__file__).resolve().parent.parent
TASKS = "tests/lm_eval_tasks"
TASK = "paged_attention_capitals"

# (context, continuation): lm-eval encodes the two apart and scores the continuation's tokens.
LOGLIKELIHOODS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Berlin"),
    ("Water is made of hydrogen and", " oxygen"),
    ("One, two, three, four,", " five, six, seven"),
    ("Question: What do bees make?\nAnswer:", " Honey"),
]
GREEDY_TOKENS = 12
GENERATIONS = [
    ("The capital of France is", {"until": ["."], "max_gen_toks": GREEDY_TOKENS}),
    (
        "Question: How many legs does a spider have?\nAnswer:",
        {"until": ["\n"], "max_gen_toks": GREEDY_TOKENS},
    ),
    ("List three colors:", {"until": ["\n\n"], "max_gen_toks": GREEDY_TOKENS}),
]
CHATS = [
    (
        [{"role": "user", "content": "What is the capital of France?"}],
        {"until": ["\n"], "max_gen_toks": 16},
    ),
    ([{"role": "user", "content": "Say hello."}], {"until": ["!"], "max_gen_toks": 8}),
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    refuse_remote_connections(monkeypatch)


@pytest.fixture(scope="module")
def smollm2_fp32():
    model, tokenizer = load_model(MODEL, dtype="float32")
    model.set_attn_implementation("sdpa")
    return model, tokenizer


class Oracle:
    """The answers of the same weights without the server, worked out before the engine takes
    the model over (it switches the model's attention to the paged one)."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """The sum of the continuation tokens' float32 log-probabilities, and whether each is
        the most likely token where it stands."""
        start, tokens = self.encode(context), self.encode(continuation)
        with torch.inference_mode():
            logits = self.model(torch.tensor([start + tokens]), use_cache=False).logits[0]
        rows = logits.float().log_softmax(-1)[len(start) - 1 : -1]
        chosen = torch.tensor(tokens)
        total = rows.gather(1, chosen[:, None]).sum().item()
        return total, bool((rows.argmax(-1) == chosen).all())

    def greedy(self, prompt: list[int], count: int, until: list[str]) -> str:
        """``count`` greedy tokens after ``prompt`` (full forward passes, no cache), decoded and
        cut before the first of ``until``, as lm-eval cuts a generation."""
        tokens = list(prompt)
        with torch.inference_mode():
            for _ in range(count):
                logits = self.model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
                tokens.append(int(logits.argmax()))
                if tokens[-1] == self.tokenizer.eos_token_id:
                    tokens.pop()
                    break
                if any(stop in self.tokenizer.decode(tokens[len(prompt) :]) for stop in until):
                    break
        text = self.tokenizer.decode(tokens[len(prompt) :])
        for stop in until:
            text = text.split(stop)[0]
        return text


def evaluate_task(model, **options) -> dict:
    """lm-eval's ``simple_evaluate`` of the capitals task, run from the project root (the task
    names its jsonl relative to it)."""
    tasks = TaskManager(include_path=str(ROOT / TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, tasks=[TASK], task_manager=tasks, log_samples=True, **options
    )


@pytest.fixture(scope="module")
def expected(smollm2_fp32):
    """Every test's oracle values, from the model before the server takes it."""
    model, tokenizer = smollm2_fp32
    oracle = Oracle(model, tokenizer)
    chat_prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m, _ in CHATS]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        hf = evaluate_task(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1))
    return {
        "loglikelihoods": [oracle.loglikelihood(*pair) for pair in LOGLIKELIHOODS],
        "generations": [
            oracle.greedy(oracle.encode(text), kw["max_gen_toks"], kw["until"])
            for text, kw in GENERATIONS
        ],
        "chats": [
            oracle.greedy(list(prompt["input_ids"]), kw["max_gen_toks"], kw["until"])
            for prompt, (_, kw) in zip(chat_prompts, CHATS)
        ],
        "hf": hf,
        "task_loglikelihoods": {
            tuple(pair): oracle.loglikelihood(*pair)
            for sample in hf["samples"][TASK]
            for pair in sample["arguments"]
        },
    }


@pytest.fixture(scope="module")
def served(smollm2_fp32, expected, tmp_path_factory):
    """The server on the model, and its tokenizer saved where lm-eval can load it by path."""
    model, tokenizer = smollm2_fp32
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, MODEL, max_n=4))
    live.tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(live.tokenizer_dir)
    yield live
    live.stop()


def completions_model(live: LiveServer, **options):
    return get_model("local-completions")(
        base_url=f"{live.url}/v1/completions",
        model=MODEL,
        tokenizer=str(live.tokenizer_dir),
        max_retries=1,
        **options,
    )


def loglikelihood_requests() -> list[Instance]:
    return [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(LOGLIKELIHOODS)
    ]


# The tokenizer by path; a batch of token-id prompts per request; concurrent requests (aiohttp).
CLIENT_OPTIONS = [{}, {"batch_size": 3}, {"num_concurrent": 3}]


@pytest.mark.parametrize("options", CLIENT_OPTIONS, ids=["one", "batched", "concurrent"])
def test_loglikelihoods_equal_transformers(served, expected, options):
    results = completions_model(served, **options).loglikelihood(loglikelihood_requests())
    assert len(results) == len(LOGLIKELIHOODS)
    for (total, greedy), (want, want_greedy) in zip(results, expected["loglikelihoods"]):
        assert total == pytest.approx(want, abs=TOLERANCE)
        assert greedy == want_greedy
    # The oracle's requests hold a greedy continuation and unlikely ones, so both answers of
    # is_greedy are checked.
    assert {greedy for _, greedy in results} == {True, False}


@pytest.mark.parametrize("options", CLIENT_OPTIONS[:2], ids=["one", "batched"])
def test_generate_until_equals_greedy_transformers(served, expected, options):
    requests = [
        Instance(request_type="generate_until", doc={}, arguments=(text, kw), idx=0)
        for text, kw in GENERATIONS
    ]
    assert completions_model(served, **options).generate_until(requests) == expected["generations"]


def test_chat_completions_generate_until_equals_greedy_transformers(served, expected):
    client = get_model("local-chat-completions")(
        base_url=f"{served.url}/v1/chat/completions", model=MODEL, max_retries=1
    )
    requests = [
        Instance(
            request_type="generate_until",
            doc={},
            arguments=(JsonChatStr(json.dumps(messages)), kw),
            idx=0,
        )
        for messages, kw in CHATS
    ]
    answers = client.generate_until(requests)
    assert answers == expected["chats"]
    assert "Paris" in answers[0]


def test_a_task_scores_as_lm_evals_hf_model_does(served, expected, monkeypatch):
    """The multiple-choice task through the server: each choice's loglikelihood equals
    transformers', and the accuracy equals lm-eval's ``hf`` model on the same weights."""
    monkeypatch.chdir(ROOT)
    model_args = f"base_url={served.url}/v1/completions,model={MODEL},"
    model_args += f"tokenizer={served.tokenizer_dir},max_retries=1"
    ours = evaluate_task("local-completions", model_args=model_args)
    hf = expected["hf"]
    assert ours["results"][TASK]["acc,none"] == hf["results"][TASK]["acc,none"]
    assert 0.25 < hf["results"][TASK]["acc,none"]  # better than chance: the task is read right
    samples, hf_samples = ours["samples"][TASK], hf["samples"][TASK]
    assert len(samples) == len(hf_samples) == 12
    for sample, hf_sample in zip(samples, hf_samples):
        assert sample["arguments"] == hf_sample["arguments"]
        assert sample["acc"] == hf_sample["acc"]
        for pair, (total, greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            want, want_greedy = expected["task_loglikelihoods"][tuple(pair)]
            assert total == pytest.approx(want, abs=TOLERANCE)
            assert greedy == want_greedy
