import re

import pytest

from policies.registry import resolve_reward
from policies.rewards.math_answers import extract_boxed
from policies.rewards.text import extract_choice_letter, token_f1
from policies.rewards.types import RewardInput


def _score(name: str, response: str, label: object) -> float:
    return resolve_reward(name)(RewardInput(prompt="q", response=response, label=label))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("first \\boxed{3}, finally \\boxed{4}", "4"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed 7$", "7"),
        ("unclosed \\boxed{12", None),
        ("no box at all", None),
    ],
)
def test_extract_boxed_takes_the_last_complete_box(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.unit
def test_math_reward_accepts_latex_equivalent_answers_and_rejects_wrong_ones() -> None:
    assert _score("math", "The answer is \\boxed{\\frac12}.", "0.5") == 1.0
    assert _score("math", "The answer is \\boxed{\\frac13}.", "0.5") == 0.0
    assert _score("math", "The answer is 0.5", "0.5") == 0.0  # unboxed answers do not count


@pytest.mark.unit
def test_deepscaler_requires_think_close_then_boxed_correct_answer() -> None:
    assert _score("deepscaler", "<think>2+2</think> so \\boxed{4}", "4") == {
        "reward": 1.0,
        "format_ok": True,
        "correct": True,
    }
    assert _score("deepscaler", "2+2 so \\boxed{4}", "4")["format_ok"] is False
    assert _score("deepscaler", "<think>\\boxed{4}</think> four", "4")["reward"] == 0.0  # box inside the thinking


# Geometry3K's answers as its test split writes them, each with a response that boxes an equivalent spelling.
GEO3K_ANSWERS = [("3\\sqrt{3}", "3 \\sqrt 3"), ("\\frac{40}{3}", "40/3"), ("60", "60^\\circ"),
                 ("2\\sqrt{221}", "2\\sqrt{221}"), ("4.5", "\\frac{9}{2}"), ("16\\pi", "16 \\pi")]


@pytest.mark.unit
@pytest.mark.parametrize(("label", "answer"), GEO3K_ANSWERS)
def test_geo3k_pays_nine_tenths_for_the_answer_and_one_tenth_for_thinking_then_boxing_it(label: str,
                                                                                      answer: str) -> None:
    shaped = f"<think>the angles sum to 180</think> so x = \\boxed{{{answer}}}."
    assert _score("geo3k", shaped, label) == {"reward": 1.0, "correct": True, "format_ok": True}
    assert _score("geo3k", f"x = \\boxed{{{answer}}}", label)["reward"] == pytest.approx(0.9)  # no thinking
    assert _score("geo3k", f"<think>x</think> x = {answer}", label)["reward"] == 0.0  # nothing boxed


@pytest.mark.unit
def test_geo3k_scores_the_last_box_and_pays_the_format_of_a_wrong_answer() -> None:
    wrong = _score("geo3k", "<think>maybe \\boxed{3\\sqrt{3}}</think> no: \\boxed{\\sqrt{3}}", "3\\sqrt{3}")
    assert wrong == {"reward": pytest.approx(0.1), "correct": False, "format_ok": True}
    # slime's format is the whole response: thinking first, a box after it
    boxed_in_thought = _score("geo3k", "<think>\\boxed{60}</think> so sixty", "60")
    assert boxed_in_thought == {"reward": pytest.approx(0.9), "correct": True, "format_ok": False}
    assert _score("geo3k", "Sure. <think>a</think> \\boxed{60}", "60")["format_ok"] is False


@pytest.mark.unit
def test_exact_match_normalizes_case_punctuation_and_articles() -> None:
    assert _score("exact_match", "<think>hmm</think> The Eiffel Tower.", "eiffel tower") == 1.0
    assert _score("exact_match", "Paris", ["London", "paris"]) == 1.0
    assert _score("exact_match", "Paris, France", "Paris") == 0.0


@pytest.mark.unit
def test_f1_is_token_overlap_harmonic_mean() -> None:
    # predicted {cat, sat}, gold {cat, sat, down}: precision 1, recall 2/3, F1 0.8
    assert token_f1("the cat sat", "cat sat down") == pytest.approx(0.8)
    assert _score("f1", "the cat sat", ["dog", "cat sat down"]) == pytest.approx(0.8)
    assert _score("f1", "nothing shared", "cat") == 0.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("Reasoning... The answer is (C).", "C"),
        ("Answer: b", "B"),
        ("I pick \\boxed{D}", "D"),
        ("Between (A) and (B), I choose (B)", "B"),
        ("A", "A"),
        ("I cannot decide", None),
    ],
)
def test_multiple_choice_letter_extraction(response: str, letter: str | None) -> None:
    assert extract_choice_letter(response) == letter


@pytest.mark.unit
def test_gpqa_reward_accepts_letter_or_index_labels() -> None:
    assert _score("gpqa", "The answer is (C)", "C") == 1.0
    assert _score("gpqa", "The answer is (C)", 2) == 1.0
    assert _score("gpqa", "The answer is (C)", "(A)") == 0.0


@pytest.mark.unit
def test_malformed_label_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="label: multiple-choice reward expects a letter or an option index"):
        _score("gpqa", "(A)", "banana")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "correct", "format_ok"),
    [
        ("37", True, True),
        ("**37**.", True, True),
        ("\\boxed{37}", True, True),
        ("23 + 14 = 37.", True, False),  # the number after the last "=", in a sentence
        ("The sum is 37 apples", True, False),  # else the last number
        ("23 + 14 = 36, no wait, 38", False, False),  # the "=" rule reads 36: no credit for a guess after it
        ("It is thirty-seven", False, False),
        ("1,037", False, True),
        ("<think>23+14 is 37</think>37", True, True),  # only the answer after a reasoning block counts
    ],
)
def test_final_number_reads_the_answer_and_says_format_and_correctness_apart(response: str, correct: bool,
                                                                             format_ok: bool) -> None:
    assert _score("final_number", response, "37") == {"reward": float(correct), "correct": correct,
                                                       "format_ok": format_ok, "truncated": False}


@pytest.mark.unit
def test_final_number_gives_no_reward_for_a_right_number_in_a_response_cut_off_at_the_limit() -> None:
    scored = resolve_reward("final_number")(RewardInput(prompt="q", response="23 + 14 = 37 and then", label="37",
                                                        finish_reason="length"))
    assert scored == {"reward": 0.0, "correct": False, "format_ok": False, "truncated": True}


@pytest.mark.unit
@pytest.mark.parametrize(("response", "reward"),
                         [("37", 1.0), ("23 + 14 = 37", 0.5), ("36", 0.0), ("23 + 14 = 36", 0.0)])
def test_final_number_brief_pays_half_for_a_right_answer_in_words(response: str, reward: float) -> None:
    assert _score("final_number_brief", response, "37")["reward"] == reward


@pytest.mark.unit
def test_final_number_compares_numbers_not_strings_and_refuses_a_label_that_is_not_one() -> None:
    assert _score("final_number", "x = 1,234.50", "1234.5")["correct"]
    assert _score("final_number", "7/2", "3.5")["correct"]
    with pytest.raises(ValueError, match="label: final_number expects a number, got 'seven'"):
        _score("final_number", "7", "seven")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "label", "pred", "acc"),
    [
        ("6 * 7 = 42.\nAnswer: 42", "42", "42", True),
        ("6 * 7 = 41.\nAnswer: 41", "42", "41", False),
        ("answer : 40\nno, 6 * 7 is 42.\nANSWER:42", 42, "42", True),  # the last answer line, any case, an int label
        ("So the answer is \\boxed{42}.", "42", "[INVALID]", False),  # no "Answer:" line: wrong whatever it says
        ("Answer: $1,000$ dollars", "1000", "1000", True),  # math span kept, unit and thousands separator dropped
        ("Answer: x = \\boxed{42}", "42.0", "42", True),  # after the last "=", the box unwrapped; 42.0 is 42
        ("Answer: 90^\\circ", "90", "90", True),
        ("Answer: \\text{42 students}", "42", "42", True),
    ],
)
def test_dapo_reads_the_last_answer_line_normalised_and_pays_one_or_minus_one(response: str, label: object,
                                                                              pred: str, acc: bool) -> None:
    assert _score("dapo", response, label) == {"reward": 1.0 if acc else -1.0, "score": 1.0 if acc else -1.0,
                                               "acc": acc, "pred": pred}


@pytest.mark.unit
def test_dapo_normal_form_braces_shorthand_latex() -> None:
    from policies.rewards.dapo import normalise_final_answer

    assert normalise_final_answer("$\\frac12$") == "\\frac{1}{2}"
    assert normalise_final_answer("y = \\sqrt3 cm") == "\\sqrt{3}"
    assert normalise_final_answer("x \\text{ and } \\textbf{y}") == "x,y"
    assert normalise_final_answer("12 \\text{ and } 13") == "1213"  # a list of digits reads as one number: Minerva's


@pytest.mark.unit
def test_dapo_reads_only_a_long_responses_last_300_characters() -> None:
    """An answer stated early and followed by 300 more characters is not the one scored; a megabyte of reasoning
    costs what its tail does."""
    assert _score("dapo", "Answer: 42\n" + "x" * 300, "42")["pred"] == "[INVALID]"
    assert _score("dapo", "Answer: 42\n" + "x" * 288, "42")["acc"]
    assert _score("dapo", "think " * 200_000 + "\nAnswer: 42", "42")["acc"]


@pytest.mark.unit
def test_dapo_strict_box_compares_the_last_box_near_the_end_as_written() -> None:
    from policies.rewards.dapo import dapo_verdict

    assert dapo_verdict("so \\boxed{41}, no: \\boxed{42}", "42", strict_box=True) == {
        "score": 1.0, "acc": True, "pred": "42"}
    assert dapo_verdict("\\boxed{42}" + "." * 100, "42", strict_box=True)["pred"] is None  # before the window
    assert dapo_verdict("\\boxed{ 42}", "42", strict_box=True)["pred"] == " 42"  # not normalised: wrong
    assert dapo_verdict("Answer: 42", "42", strict_box=True) == {"score": -1.0, "acc": False, "pred": None}
    assert dapo_verdict("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", strict_box=True)["acc"]  # any label, as written
    # from 100 characters before the last pause token on
    early_box = "." * 50 + "\\boxed{42}" + "." * 140
    assert not dapo_verdict(early_box, "42", strict_box=True)["acc"]
    assert dapo_verdict(early_box, "42", strict_box=True, pause_positions=[0, 0, 0, 150])["acc"]
    with pytest.raises(ValueError, match=r"pause_tokens_index: 4 positions expected \(slime's\), got 1"):
        dapo_verdict("\\boxed{42}", "42", strict_box=True, pause_positions=[3])


@pytest.mark.unit
def test_dapo_refuses_a_label_that_is_not_an_integer_naming_it() -> None:
    for label in ("3.5", "\\frac{1}{2}", "seven"):
        with pytest.raises(ValueError, match=f"label: dapo's answer line is compared with an integer label .*got "
                                             f"{re.escape(repr(label))}"):
            _score("dapo", "Answer: 3", label)


_STEPS_PROMPT = "Tom has 23 apples. Tom buys 7 more, then gives 5 away, then finds 3 more. How many apples now?"
_STEPS_WORKED = ("Tom starts with 23 apples. He buys 7 more, so he has 23 + 7 = 30 apples. Then he gives 5 away, "
                 "so he has 30 - 5 = 25 apples.\nThen he finds 3 more: 25 + 3 = 28.\nThe final answer is 28.")


def _steps(response: str, finish_reason: str | None = "stop") -> dict[str, object]:
    return resolve_reward("worked_steps")(RewardInput(prompt=_STEPS_PROMPT, response=response, label=[30, 25, 28],
                                                      finish_reason=finish_reason))  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(("response", "reward", "correct"), [
    (_STEPS_WORKED, 1.0, True),  # every result in its own sentence, restated facts and repeats passed over
    ("1. Tom buys 7 more: 23 + 7 = 30.\n2. He gives 5 away: 25.\n3. He finds 3: 28.\nAnswer: 28", 1.0, True),
    ("Tom has 28 apples now.", 0.0, False),  # the right answer without the working earns nothing
    ("Tom buys 7 more, gives 5 away and finds 3 more, so he has 23 + 7 - 5 + 3 = 28.", 0.0, False),  # one sentence
    ("So he has 30 apples. Then 31. Then 25. Then 28.", 1 / 3, False),  # a wrong claim ends the chain
    ("He has 30 apples. Then he has 24 apples. Then 28.", 1 / 3, False),
    ("He has 30 apples. Then he has 25. Then he has 28. Or maybe 29.", 2 / 3, False),  # a wrong number after the end
    ("He has 25 apples. Then 30. Then 28.", 0.0, False),  # out of order
])
def test_worked_steps_pays_for_each_result_stated_in_order_not_for_the_answer_alone(
        response: str, reward: float, correct: bool) -> None:
    scored = _steps(response)
    assert (scored["reward"], scored["correct"]) == (pytest.approx(reward), correct)


@pytest.mark.unit
def test_worked_steps_says_how_much_of_the_chain_was_stated_and_pays_nothing_for_a_cut_off_answer() -> None:
    assert _steps("He has 30 apples. Then he has 25.")["steps_stated"] == pytest.approx(2 / 3)
    cut = _steps(_STEPS_WORKED, finish_reason="length")
    assert {key: cut[key] for key in ("reward", "correct", "steps_stated", "truncated")} == {
        "reward": 0.0, "correct": False, "steps_stated": 1.0, "truncated": True}


def _graded(response: str, finish_reason: str = "stop") -> list[tuple[str, float]]:
    """The steps worked_steps graded, each as the text up to its end (the last 12 characters) and its reward."""
    return [(response[:end][-12:], reward) for end, reward in _steps(response, finish_reason)["step_rewards"]]


@pytest.mark.unit
def test_worked_steps_grades_each_step_where_its_sentence_ends() -> None:
    # every link but the last ends with its sentence; the last runs to the end (the answer and what follows it)
    assert _graded(_STEPS_WORKED) == [("= 30 apples.", 1.0), ("= 25 apples.", 1.0), ("nswer is 28.", 1.0)]
    # a slip: the right links keep their credit, the step that breaks the chain (and ends it) earns 0
    slipped = "So he has 23 + 7 = 30 apples. Then 30 - 5 = 26. Then 26 + 3 = 29."
    assert _graded(slipped) == [("= 30 apples.", 1.0), ("30 - 5 = 26.", 0.0)]
    # list markers are blanked, not cut: the offsets are the response's own
    listed = "1. Tom buys 7 more: 23 + 7 = 30.\n2. He gives 5 away: 25.\n3. He finds 3: 28.\nAnswer: 28"
    assert _graded(listed) == [("23 + 7 = 30.", 1.0), (" 5 away: 25.", 1.0), (".\nAnswer: 28", 1.0)]
    # cut off at the length limit: the working before the cut is graded, the end earns 0
    assert _graded("He has 30 apples. Then he has 25 apples. Then", "length") == [
        ("s 30 apples.", 1.0), ("s 25 apples.", 1.0), ("apples. Then", 0.0)]
    # after a reasoning block, offsets still count from the response's start
    thought = "<think>23 and 7</think>He has 30 apples. Then 25. Then 28."
    assert _graded(thought) == [("s 30 apples.", 1.0), ("es. Then 25.", 1.0), ("25. Then 28.", 1.0)]


@pytest.mark.unit
@pytest.mark.parametrize("label", ["28", [], [30, "many"]])
def test_worked_steps_refuses_a_label_that_is_not_a_chain_of_numbers(label: object) -> None:
    with pytest.raises(ValueError, match="label: worked_steps expects a non-empty list of numbers"):
        _score("worked_steps", "28", label)
