"""Structured outputs on the tiny model (random weights: only the grammar makes the text valid):
200 random JSON schemas whose outputs all parse and validate with jsonschema, regexes and
choices likewise, EBNF grammars, "length" when a grammar cannot finish, constrained requests
batched with free ones (each as alone), prefix caching, and clear errors for bad specs."""

import json
import random
import re
import time
from pathlib import Path

import jsonschema
import pytest

from engine.llm import LLM
from engine.request import EngineOverloaded, InvalidRequest, SamplingParams
from engine.structured_output import choice_grammar

PROMPTS = ["The quick brown fox", "Hello there", "1 2 3", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", max_num_seqs=256)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, bounded integers and numbers, strings with patterns; every
    value bounded so that a random model can finish it in a few dozen tokens."""
    kinds = ["string", "pattern", "integer", "number", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 5)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,3}$", "^[0-9]{2}-[A-Z]$", "^(ab|cd)x?$"])}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "tags", "score", "kind", "next", "ok"], rng.randint(1, 3))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


def constrained(spec: dict, seed: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured_outputs={**spec, "disable_any_whitespace": True})


def test_200_random_schemas_give_json_that_validates(llm):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(200)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(200)],
                        [constrained({"json": s}, seed=i) for i, s in enumerate(schemas)])
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regexes_and_choices_are_matched_exactly(llm):
    regexes = [r"[a-c]{2,4}-\d{1,3}", r"(foo|bar)+x?", r"[A-Z][a-z]{0,5}\.", r"\d{3}-\d{4}", r"(yes|no|maybe)!?",
               r"[0-9a-f]{8}", r"a(b|c){1,3}d", r"(\w{1,3} ){1,3}end"]
    choices = [["yes", "no"], ["alpha", "beta", "gamma delta"], ['say "hi"', "back\\slash", "new\nline"], ["x"]]
    specs = [{"regex": r} for r in regexes] + [{"choice": c} for c in choices]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(specs) * 3)],
                        [constrained(spec, seed=i) for i, spec in enumerate(specs * 3)])
    for spec, out in zip(specs * 3, outs):
        assert out.finish_reason == "stop", (spec, out.text)
        if "regex" in spec:
            assert re.fullmatch(spec["regex"], out.text), (spec, out.text)
        else:
            assert out.text in spec["choice"], (spec, out.text)


def test_an_ebnf_grammar_and_choice_as_a_grammar(llm):
    grammar = 'root ::= "(" num (("+" | "*") num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    outs = llm.generate(PROMPTS, [constrained({"grammar": grammar}, seed=i) for i in range(4)])
    assert all(o.finish_reason == "stop" and re.fullmatch(r"\([1-9]\d{0,2}([+*][1-9]\d{0,2}){0,3}\)", o.text)
               for o in outs), [o.text for o in outs]
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate([PROMPTS[0]], [constrained({"regex": "a{60}"}, seed=1, max_tokens=5)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text and set(out.text) == {"a"}


def test_constrained_and_free_requests_batched_are_each_as_alone(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    params = [constrained({"json": schema}, seed=1), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              constrained({"regex": "[a-z]{3,6}"}, seed=2), SamplingParams(max_tokens=12, temperature=0.9, seed=3,
                                                                          ignore_eos=True)]
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert json.loads(together[0].text)["b"] in ("x", "y")


def test_prefix_cache_hits_keep_the_grammar(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=True)
    prompt = list(range(5, 300))  # longer than the window: the second run hits the cache
    sp = constrained({"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}}, seed=7)
    first, second = (llm.generate([prompt], [sp])[0] for _ in range(2))
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    for out in (first, second):  # after a hit the logits are close to a cold run's, not identical: both valid
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), sp.structured_outputs["json"])


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "foo"}}, 'structured_outputs.json cannot be compiled: Unsupported type "foo"'),
    ({"regex": "(ab"}, "structured_outputs.regex cannot be compiled: Regex parsing error"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
])
def test_bad_specs_are_refused_naming_the_problem(llm, spec, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=4, structured_outputs=spec)])
    assert not llm.engine.has_unfinished()


def test_ignore_eos_with_a_grammar_is_refused(llm):
    with pytest.raises(InvalidRequest, match="ignore_eos cannot be combined with structured_outputs"):
        llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs={"regex": "a+"})])


def _many_optional_properties(n: int, tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


def test_a_slow_schema_fails_within_its_budget_and_holds_no_other_request():
    """xgrammar's compile grows superlinearly with optional properties: two such schemas used to
    hold both compile workers while a trivial choice waited behind them."""
    from engine.structured_output import GrammarCompiler
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(Path(__file__).resolve().parents[2] / "engine" / "data"))
    # a 2500-property schema compiles for ~14 s on the 2-core machine, a choice in ~1 ms: with a 3 s budget
    # the choice has ample time to finish first even on a loaded machine, and the slow ones fail at the budget
    budget = 3.0
    compiler = GrammarCompiler(tokenizer, len(tokenizer.token_bytes), [0], budget_s=budget, max_running=3)
    started = time.monotonic()
    slow = [compiler.compile({"json": _many_optional_properties(2500, tag)}) for tag in ("a", "b")]
    choice = compiler.compile({"choice": ["yes", "no"]})
    choice.result(timeout=30)
    assert not any(f.done() for f in slow), "the choice waited behind the slow schemas"
    for future in slow:
        with pytest.raises(InvalidRequest, match="did not compile within 3 s"):
            future.result(timeout=30)
    assert time.monotonic() - started < budget + 2  # at the budget, not at the end of their ~14 s compiles
    # still compiling: the same schema is refused at once; with a third running, a fourth finds no room
    with pytest.raises(InvalidRequest, match="did not compile within"):
        compiler.compile({"json": _many_optional_properties(2500, "a")}).result(timeout=0.1)
    compiler.compile({"json": _many_optional_properties(2500, "c")})
    with pytest.raises(EngineOverloaded):
        compiler.compile({"json": _many_optional_properties(2500, "d")}).result(timeout=0.1)
