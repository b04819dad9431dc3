"""Scorer unit tests on hand-made examples (no model, no data)."""

from __future__ import annotations

import pytest

from kvdex.eval import metrics as M
from kvdex.eval.prompting import fit, truncate_middle


def test_string_match():
    assert M.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert M.string_match_all("VAR ABCDE", ["abcde"]) == 1.0  # case-insensitive
    assert M.string_match_part("It is Paris, France", ["London", "paris"]) == 1.0
    assert M.string_match_part("no idea", ["London", "Paris"]) == 0.0


def test_normalize_and_f1():
    assert M.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert M.normalize_answer("An apple, a pear.") == "apple pear"
    assert M.qa_f1("the Eiffel Tower", "Eiffel Tower") == 1.0
    # pred [eiffel, tower, in, paris] vs ref [eiffel, tower]: P = 1/2, R = 1 -> F1 = 2/3
    assert M.qa_f1("Eiffel Tower in Paris", "The Eiffel Tower") == pytest.approx(2 / 3)
    assert M.qa_f1("London", "Paris") == 0.0
    assert M.qa_f1("", "Paris") == 0.0
    assert M.token_f1(["a", "a", "b"], ["a", "b", "b"]) == pytest.approx(2 / 3)  # counts, not sets


def test_chinese_normalisation_and_f1():
    assert M.normalize_zh_answer("你好，世界！ Hi.") == "你好世界hi"
    assert M.qa_f1_zh("北京", "北京") == 1.0
    assert M.qa_f1_zh("上海", "北京") == 0.0
    if M.ZH_TOKENIZER == "chars":  # 北京 vs 北京市: chars P = 1, R = 2/3
        assert M.qa_f1_zh("北京", "北京市") == pytest.approx(0.8)


def test_rouge_l():
    assert M.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    assert M.rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # pred 4 words, ref 6, LCS "the cat the mat" = 4 -> P = 1, R = 2/3, F = 0.8
    assert M.rouge_l("the cat the mat", "the cat sat on the mat") == pytest.approx(0.8)
    assert M.rouge_l("", "anything") == 0.0
    assert M.rouge_l_zh("今天天气很好", "今天天气很好") == 1.0


def test_classification():
    classes = ["location", "other location", "person", "number"]
    assert M.classification_score("other location", "other location", classes) == 1.0  # substring not counted
    assert M.classification_score("person or number", "person", classes) == 0.5
    assert M.classification_score("location", "person", classes) == 0.0


def test_retrieval_count_code():
    assert M.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert M.retrieval_score("段落5", "段落5") == 1.0
    assert M.retrieval_score("I don't know", "Paragraph 12") == 0.0
    assert M.count_score("There are 7 unique paragraphs", "7") == 1.0
    assert M.count_score("7 or 8", "7") == 0.5
    assert M.code_sim_score("```python\n    return x + 1\n", "    return x + 1") == 1.0
    assert 0.5 < M.code_sim_score("return x + 2", "return x + 1") < 1.0
    assert M.first_line("\nDescription\nQuestion: next") == "Description"


def test_last_boxed():
    assert M.last_boxed(r"so \boxed{1} and finally \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert M.last_boxed("no box") is None
    assert M.last_boxed(r"\boxed{unclosed") is None


def test_fit_and_truncate():
    class CharTok:  # one token per character
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": list(text)}

    text, n = fit(CharTok(), lambda n: "Q:" + "ab" * n, 11)
    assert (text, n) == ("Q:abababab", 4)
    with pytest.raises(ValueError, match="shorter"):
        fit(CharTok(), lambda n: "Q:" + "ab" * n, 1)
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(3)), 4) == [0, 1, 2]


def test_math_answers():
    assert M.gsm8k_gold("She makes 9 * 2 = $18.\n#### 1,018") == "1018"
    pairs_equal = [
        (r"\dfrac{14}{3}", r"\frac{14}{3}"),
        ("90", r"90^\circ"),
        ("x=5", "5"),
        (r"\text{Evelyn}", "Evelyn"),
        ("13,535", "13535"),
        ("0.5", r"\frac12"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"11\sqrt2", r"11\sqrt{2}"),
        ("18.00", "18"),
        (r"-\frac{1}{2}", "-0.5"),
    ]
    for a, b in pairs_equal:
        assert M.math_equal(a, b), (a, b)
    assert not M.math_equal("17", "18")
    assert not M.math_equal(None, "1")
    assert not M.math_equal(r"\frac{1}{3}", "0.33")
    assert M.extract_math_answer(r"First 3, so \boxed{42}. Done") == "42"
    assert M.extract_math_answer("so the answer is 42.") == "42"
    assert M.extract_math_answer("We get 3 then 7") == "7"
