"""Metrics against values computed by hand from the reference definitions (RULER, LongBench)."""

from __future__ import annotations

import math

import pytest

from eval.benchmarks.longbench.scoring import (
    code_sim_score,
    length_bucket,
    longbench_dataset_score,
    longbench_e_scores,
    longbench_score,
)
from eval.benchmarks.ruler.scoring import ruler_score

# ------------------------------------------------------------------------------------------------ RULER


def test_ruler_string_match_all_is_the_share_of_references_found():
    assert ruler_score(
        "niah_multivalue", "They are 1234567, 7654321 and 42.", ["1234567", "7654321", "1111111"]
    ) == (pytest.approx(200 / 3))
    assert ruler_score("vt", "ABCDE fghij", ["abcde", "FGHIJ"]) == 100.0  # case-insensitive
    assert ruler_score("cwe", "", ["word"]) == 0.0
    assert ruler_score("niah_single_1", "  \x00\x01 7654321\t", ["7654321"]) == 100.0


def test_ruler_control_characters_become_newlines_like_the_reference():
    # RULER replaces control characters by "\n": a value split by one is not found
    assert ruler_score("niah_single_1", "765\x004321", ["7654321"]) == 0.0
    assert ruler_score("niah_single_1", "765\x004321", ["765\n4321"]) == 100.0


def test_ruler_string_match_part_for_qa():
    assert ruler_score("qa_1", "Paris, France", ["paris", "Lyon"]) == 100.0
    assert ruler_score("qa_2", "Marseille", ["paris", "Lyon"]) == 0.0
    assert ruler_score("niah_multivalue", "Paris, France", ["paris", "Lyon"]) == 50.0


def test_ruler_unknown_task():
    with pytest.raises(ValueError):
        ruler_score("needle", "x", ["x"])


# ----------------------------------------------------------------------------------------------- qa_f1


def test_qa_f1_normalises_case_punctuation_and_articles():
    assert longbench_score("hotpotqa", "The Eiffel Tower!", ["eiffel tower"]) == 100.0
    assert longbench_score("narrativeqa", "U.S.A.", ["USA"]) == 100.0
    # pred {big, red, apple} vs gold {red, apple, pie}: P = R = 2/3
    assert longbench_score("qasper", "a big red apple", ["the red apple pie"]) == pytest.approx(200 / 3)
    # "an" inside "another" is not an article: P = 1/2, R = 1, F1 = 2/3
    assert longbench_score("musique", "another theatre", ["theatre"]) == pytest.approx(200 / 3)


def test_qa_f1_takes_the_best_ground_truth_and_empty_scores_zero():
    # vs "paris": P = 1/4, R = 1 -> 0.4; vs "city of paris": P = 3/4, R = 1 -> 6/7
    assert longbench_score(
        "2wikimqa", "city of Paris France", ["Paris", "the city of Paris"]
    ) == pytest.approx(600 / 7)
    assert longbench_score("2wikimqa", "", ["Paris"]) == 0.0
    assert longbench_score("2wikimqa", "London", ["Paris", "Rome"]) == 0.0


def test_first_line_rule_only_for_trec_triviaqa_samsum_lsht():
    prediction = "\n\nParis\nThe answer is London"
    assert longbench_score("triviaqa", prediction, ["London"]) == 0.0
    assert longbench_score("triviaqa", prediction, ["Paris"]) == 100.0
    # hotpotqa scores the whole text: {paris, answer, is, london} vs {london}: F1 = 2 * 1/4 / (5/4) = 0.4
    assert longbench_score("hotpotqa", prediction, ["London"]) == pytest.approx(40.0)


# ----------------------------------------------------------------------------------------------- rouge


def test_rouge_l_is_the_rouge_packages_definition():
    # `rouge` counts distinct words: hyp {the, cat, sat, on, mat}, ref {the, cat, is, on, mat},
    # LCS words {the, cat, on, mat} -> P = R = 4/5, F = 0.8 (rouge-score would give 5/6)
    assert longbench_score(
        "gov_report", "the cat sat on the mat", ["the cat is on the mat"]
    ) == pytest.approx(80.0, abs=1e-4)
    # case-sensitive: hyp has 6 distinct words, LCS {cat, on, the, mat}: P = 4/6, R = 4/5, F = 8/11
    assert longbench_score("qmsum", "The cat sat on the mat", ["the cat is on the mat"]) == pytest.approx(
        800 / 11, abs=1e-4
    )


def test_rouge_empty_prediction_scores_zero_and_samsum_uses_the_first_line():
    assert longbench_score("multi_news", "", ["some reference text"]) == 0.0
    assert longbench_score(
        "samsum", "Ann will call Ben.\nDialogue: more", ["Ann will call Ben."]
    ) == pytest.approx(100.0, abs=1e-4)


# -------------------------------------------------------------------------------------- classification

CLASSES = ["Animal", "City", "Description of a person", "person", "man", "woman", "Description of a woman"]


def test_classification_found_classes():
    assert longbench_score("trec", "City", ["City"], CLASSES) == 100.0
    assert longbench_score("trec", "Animal or City", ["City"], CLASSES) == 50.0
    assert longbench_score("trec", "Animal", ["City"], CLASSES) == 0.0
    assert longbench_score("trec", "", ["City"], CLASSES) == 0.0
    assert longbench_score("trec", "City\nAnimal", ["City"], CLASSES) == 100.0  # first line only


def test_classification_names_contained_in_the_gold_class():
    # "person" is inside the gold class and is dropped: found = [gold] -> 1
    assert longbench_score("trec", "Description of a person", ["Description of a person"], CLASSES) == 100.0
    # found = [man, woman, Description of a woman]; the reference removes "man" while iterating, which
    # skips "woman", so found = [woman, Description of a woman] -> 1/2
    assert longbench_score("trec", "Description of a woman", ["Description of a woman"], CLASSES) == 50.0


def test_classification_needs_all_classes():
    with pytest.raises(ValueError):
        longbench_score("trec", "City", ["City"])


# ----------------------------------------------------------------------------------- retrieval / count


def test_retrieval_and_count():
    assert longbench_score("passage_retrieval_en", "Paragraph 12", ["Paragraph 12"]) == 100.0
    assert longbench_score("passage_retrieval_en", "Paragraph 1 or Paragraph 12", ["Paragraph 12"]) == 50.0
    assert longbench_score("passage_retrieval_en", "Paragraph 120", ["Paragraph 12"]) == 0.0
    assert longbench_score("passage_retrieval_en", "I do not know", ["Paragraph 12"]) == 0.0
    assert longbench_score("passage_retrieval_zh", "答案是段落3", ["段落3"]) == 100.0
    assert longbench_score("passage_count", "There are 7 unique paragraphs out of 12", ["7"]) == 50.0
    assert longbench_score("passage_count", "", ["7"]) == 0.0


# --------------------------------------------------------------------------------------------- code_sim


def test_code_sim_skips_fences_and_comments():
    fenced = "```python\n# add them\nreturn a + b\n```"
    assert longbench_score("lcc", fenced, ["return a + b"]) == 100.0
    # first usable line "return a+b": difflib blocks "return a", "+", "b" -> 2 * 10 / 22 -> round(90.9) = 91
    assert longbench_score("repobench-p", "\n\n// comment\nreturn a+b", ["return a + b"]) == 91.0
    assert longbench_score("lcc", "# only a comment\n```", ["x = 1"]) == 0.0
    assert longbench_score("lcc", "", ["x = 1"]) == 0.0


def test_code_sim_is_fuzzywuzzy_ratio_not_levenshtein():
    # difflib's greedy longest block "ab" leaves nothing else: 2 * 2 / 11 -> round(36.4) = 36;
    # an LCS-based ratio (rapidfuzz) would give 2 * 3 / 11 = 54.5
    assert code_sim_score("babbaa", "aaaab") == 0.36
    # rounded to an integer percentage like fuzzywuzzy: 2 * 9 / 28 = 64.29 -> 64
    assert longbench_score("lcc", "abcd efgh ijkl", ["ijkl abcd efgh"]) == 64.0


# --------------------------------------------------------------------------------------------- Chinese


def test_chinese_metrics_segment_with_jieba():
    # jieba: 北京/是/中国/的/首都 vs 北京: P = 1/5, R = 1 -> F1 = 1/3
    assert longbench_score("multifieldqa_zh", "北京是中国的首都", ["北京"]) == pytest.approx(100 / 3)
    assert longbench_score("multifieldqa_zh", "北京。", ["北京"]) == 100.0  # punctuation token dropped
    # 我/爱/北京 vs 我/爱/上海: LCS 2 of 3 -> 2/3
    assert longbench_score("vcsum", "我爱北京", ["我爱上海"]) == pytest.approx(200 / 3, abs=1e-4)
    assert longbench_score("lsht", "体育\n财经", ["体育"], ["体育", "财经"]) == 100.0


# ---------------------------------------------------------------------------------------- aggregation


def test_dataset_score_and_longbench_e_buckets():
    assert longbench_dataset_score("hotpotqa", ["Paris", "x", "y"], [["Paris"], ["Rome"], ["Oslo"]]) == 33.33
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    scores = longbench_e_scores(
        "hotpotqa_e",
        ["Paris", "no", "Rome", "Rome", "Oslo"],
        [["Paris"], ["Paris"], ["Rome"], ["Oslo"], ["Oslo"]],
        [100, 3999, 4000, 7999, 9000],
    )
    assert scores == {"0-4k": 50.0, "4-8k": 50.0, "8k+": 100.0}
    assert math.isnan(longbench_e_scores("trec", ["City"], [["City"]], [10], ["City"])["8k+"])


def test_unknown_dataset():
    with pytest.raises(ValueError):
        longbench_score("nq", "x", ["x"])
