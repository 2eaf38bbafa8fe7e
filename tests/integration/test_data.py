import codecs
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rloo.data import contamination, gsm8k, synthetic
from rloo.data.gsm8k import DataError
from rloo.errors import InputError, MissingInputError
from rloo.io import read_jsonl
from rloo.reward.verifier import extract_answer
from rloo_workflow.stages import prepare

MICRO = Path(__file__).resolve().parents[2] / "config" / "micro.yaml"


def test_generator_is_deterministic_and_disjoint():
    a_train, a_test, _ = synthetic.generate(300, 50, seed=3)
    b_train, b_test, _ = synthetic.generate(300, 50, seed=3)
    c_train, _, _ = synthetic.generate(300, 50, seed=4)
    assert a_train == b_train and a_test == b_test
    assert a_train != c_train
    assert not {r["question"] for r in a_train} & {r["question"] for r in a_test}
    assert len({r["question"] for r in a_train}) == 300


def test_generator_difficulty_mix():
    train, _, _ = synthetic.generate(2000, 10, seed=0, step_weights=[0.25, 0.25, 0.25, 0.25])
    counts = {s: sum(r["steps"] == s for r in train) for s in (1, 2, 3, 4)}
    assert all(400 < c < 600 for c in counts.values()), counts
    only_one, _, _ = synthetic.generate(50, 5, seed=0, step_weights=[1.0])
    assert {r["steps"] for r in only_one} == {1}


_ANNOT = re.compile(r"<<([^=<>]+)=([^<>]+)>>([^\n]*)")


def test_every_annotation_evaluates_and_final_answer_matches():
    train, test, _ = synthetic.generate(1000, 100, seed=1)
    for r in train + test:
        lines = r["answer"].split("\n")
        assert lines[-1].startswith("#### ")
        steps = _ANNOT.findall(r["answer"])
        assert len(steps) == r["steps"]
        value = None
        for expr, result, after in steps:
            # Only + - * / of whole numbers appear; the calculator result must be exact.
            assert re.fullmatch(r"\d+[-+*/]\d+", expr), expr
            exact = eval(expr)
            assert exact == int(exact) and int(result) == exact and after.startswith(result)
            value = int(result)
        assert extract_answer(r["answer"], "strict") == str(value)
        assert value >= 0


def test_jsonl_release_format(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        {"question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
        {"question": "Weng earns $12 an hour. She worked 50 minutes. How much did she earn?",
         "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, report = gsm8k.load_jsonl_split(str(path))
    assert [r["question"] for r in records] == [r["question"] for r in rows]
    assert report.skipped == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "answer": "a #### 3"', "malformed JSON"),
        ('{"question": "q"}', "missing field 'answer'"),
        ('{"question": "q", "answer": "no final number"}', "no parseable final '#### N'"),
        ('[1, 2]', "expected a JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        gsm8k.load_jsonl_split(str(path))
    records, report = gsm8k.load_jsonl_split(str(path), on_bad="skip")
    assert len(records) == 3 and report.skipped == 1


def _shares_a_run(a: list[str], b: list[str], n: int) -> bool:
    """Whether word lists a and b have n consecutive words in common, by brute force."""
    return any(a[i:i + n] == b[j:j + n] for i in range(len(a) - n + 1) for j in range(len(b) - n + 1))


def test_prepare_synthetic_writes_splits_and_manifest(tmp_path, micro_cfg):
    manifest = prepare.run(micro_cfg, tmp_path)
    train = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(train) == manifest["counts"]["train"] == 256
    assert manifest["train_test_overlap"] == 0
    # the embedded generator's templates share 13-word runs by construction: counted, not refused
    test = [contamination.words(json.loads(t)["question"]) for t in (tmp_path / "test.jsonl").read_text().splitlines()]
    runs = sum(any(_shares_a_run(contamination.words(json.loads(t)["question"]), b, 13) for b in test) for t in train)
    assert manifest["train_test_ngram_overlap"] == {"words": 13, "count": runs, "mode": "count"} and runs > 0
    assert manifest["source"] == "synthetic" and manifest["seed"] == 0
    assert set(json.loads(train[0])) == {"question", "answer"}
    from rloo.io import sha256_file

    assert manifest["sha256"]["test"] == sha256_file(tmp_path / "test.jsonl")


def test_prepare_jsonl_skip_counts_in_manifest(tmp_path, micro_cfg):
    tr, te = tmp_path / "tr.jsonl", tmp_path / "te.jsonl"
    good = "".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(3))
    tr.write_text(f"{good}not json\n")
    te.write_text(json.dumps({"question": "q9", "answer": "#### 9"}) + "\n")
    micro_cfg["data"].update(source="jsonl", train_file=str(tr), test_file=str(te), on_bad_record="skip",
                             val_examples=1)
    manifest = prepare.run(micro_cfg, tmp_path / "out")
    assert manifest["skipped"] == {"train": 1, "test": 0}
    assert manifest["counts"] == {"train": 2, "test": 1, "val": 1}


def test_validation_split_is_disjoint_and_leaves_train_and_test_unchanged(tmp_path, micro_cfg):
    """val.jsonl: problems of their own, never a test problem; adding it changes neither other split."""
    manifest = prepare.run(micro_cfg, tmp_path / "a")
    rows = {s: [r for _, r in read_jsonl(tmp_path / "a" / f"{s}.jsonl")] for s in ("train", "test", "val")}
    assert manifest["counts"]["val"] == len(rows["val"]) == micro_cfg["data"]["val_examples"]
    questions = {s: {r["question"] for r in v} for s, v in rows.items()}
    assert not questions["val"] & questions["test"] and not questions["val"] & questions["train"]
    micro_cfg["data"]["val_examples"] = 3
    prepare.run(micro_cfg, tmp_path / "b")
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    # from a train file: held out of it at random, the test file untouched
    tr, te = tmp_path / "tr.jsonl", tmp_path / "te.jsonl"
    tr.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(20)))
    te.write_text(json.dumps({"question": "t", "answer": "#### 1"}) + "\n")
    micro_cfg["data"].update(source="jsonl", train_file=str(tr), test_file=str(te), val_examples=5)
    manifest = prepare.run(micro_cfg, tmp_path / "c")
    train = {r["question"] for _, r in read_jsonl(tmp_path / "c" / "train.jsonl")}
    val = {r["question"] for _, r in read_jsonl(tmp_path / "c" / "val.jsonl")}
    assert len(val) == 5 and len(train) == 15 and not train & val
    micro_cfg["data"]["val_examples"] = 20
    with pytest.raises(ValueError, match=r"data\.val_examples=20 leaves no training records"):
        prepare.run(micro_cfg, tmp_path / "d")


def test_prepare_error_keeps_previous_outputs(tmp_path, micro_cfg):
    prepare.run(micro_cfg, tmp_path)
    before = (tmp_path / "train.jsonl").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "none"}\n')
    micro_cfg["data"].update(source="jsonl", train_file=str(bad), test_file=str(bad))
    with pytest.raises(DataError, match=r"bad\.jsonl:1"):
        prepare.run(micro_cfg, tmp_path)
    assert (tmp_path / "train.jsonl").read_bytes() == before


# -- GSM8K-like sets: other field names (data.fields), bare numbers (data.answer_format) -----------------
MAPPED = {"question": "problem", "answer": "result"}


def test_other_field_names_and_bare_numbers_are_prepared_in_gsm8k_form(tmp_path, micro_cfg):
    """config/examples/your-data.yaml's files: {"id", "problem", "result": 85, "steps"} records."""
    from pathlib import Path

    from rloo.data.gsm8k import solution_steps
    from rloo.reward.verifier import is_correct

    examples = Path(__file__).resolve().parents[2] / "config" / "examples" / "data"
    micro_cfg["data"].update(source="jsonl", train_file=str(examples / "word_problems_train.jsonl"),
                             test_file=str(examples / "word_problems_test.jsonl"), fields=MAPPED,
                             answer_format="number", val_examples=20)
    prepare.run(micro_cfg, tmp_path)
    raw = [r for _, r in read_jsonl(examples / "word_problems_test.jsonl")]
    test = [r for _, r in read_jsonl(tmp_path / "test.jsonl")]
    assert len(test) == len(raw) == 40
    for given, got in zip(raw, test, strict=True):
        # the question and answer under the pipeline's names, the answer as '#### N'; the other fields kept
        assert got == {"question": given["problem"], "answer": f"#### {given['result']}", "id": given["id"],
                       "steps": given["steps"]}
        assert solution_steps(got["answer"]) == 0
        # the verifier grades a completion against the bare number, written in any of its forms
        assert is_correct(f"So the answer is\n#### {given['result']:,}.00", got["answer"])
        assert not is_correct(f"#### {given['result'] + 1}", got["answer"])
    assert len([1 for _ in read_jsonl(tmp_path / "train.jsonl")]) == 180


@pytest.mark.parametrize(("line", "message"), [
    ('{"question": "q?", "result": 4}', "bad.jsonl:2: missing field 'problem' (data.fields.question)"),
    ('{"problem": "q?", "result": "about 4"}', "bad.jsonl:2: field 'result' is not a number (data.answer_format: number): 'about 4'"),
    ('{"problem": "q?", "result": true}', "bad.jsonl:2: field 'result' is not a number (data.answer_format: number): True"),
    ('{"problem": "q?", "result": 4, "question": "other"}',
     "bad.jsonl:2: field 'question' would be replaced by field 'problem' (data.fields.question); rename one of them"),
])
def test_a_bad_mapped_record_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "ok?", "result": "1,000"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        gsm8k.load_jsonl_split(str(path), fields=MAPPED, answer_format="number")
    assert str(info.value) == f"{path.parent}/{message}"


def test_a_mapped_gsm8k_answer_still_needs_its_marker(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "q?", "solution": "2 + 2 = 4"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: solution has no parseable final '#### N'$"):
        gsm8k.load_jsonl_split(str(path), fields={"question": "problem", "answer": "solution"})


def _contaminated(tmp_path, micro_cfg, shared: int = 10) -> list[dict]:
    """A JSONL train file of 40 problems and a test file of 32, `shared` of the training problems (none
    of those prepare holds out for validation) in both."""
    train, test, _ = synthetic.generate(40, 22, seed=5)
    rest, _ = prepare.hold_out(train, 4, micro_cfg["seed"])  # what stays in the training split
    rows = lambda rs: "".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rs)  # noqa: E731
    (tmp_path / "tr.jsonl").write_text(rows(train))
    (tmp_path / "te.jsonl").write_text(rows(test + rest[:shared]))
    micro_cfg["data"].update(source="jsonl", train_file=str(tmp_path / "tr.jsonl"),
                             test_file=str(tmp_path / "te.jsonl"), val_examples=4)
    return rest[:shared]


def test_train_test_contamination_is_an_error_naming_the_count_and_the_first_problems(tmp_path, micro_cfg):
    shared = _contaminated(tmp_path, micro_cfg)
    with pytest.raises(InputError) as e:
        prepare.run(micro_cfg, tmp_path / "out")
    msg = str(e.value)
    assert msg.startswith("data: 10 training problems also occur in the test split (compared with case, whitespace, "
                          "punctuation and number formatting normalised; first: "), msg
    assert "data.allow_train_test_overlap: true" in msg and "\n" not in msg
    quoted = re.findall(r"'([^']+)'", msg.split("first: ", 1)[1])
    assert len(quoted) == prepare.SHOWN and all(any(s["question"].startswith(q.removesuffix("...")) for s in shared)
                                               for q in quoted), msg
    assert not (tmp_path / "out").exists()  # nothing written


def test_allowed_contamination_is_a_warning_counted_in_the_manifest_and_summary(tmp_path, micro_cfg, caplog):
    _contaminated(tmp_path, micro_cfg)
    micro_cfg["data"]["allow_train_test_overlap"] = True
    with caplog.at_level("WARNING", logger="rloo.prepare"):
        manifest = prepare.run(micro_cfg, tmp_path / "out")
    assert manifest["train_test_overlap"] == 10
    warned = [r.getMessage() for r in caplog.records if "also occur in the test split" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("!!!"), warned
    from rloo.eval.report import prepare_lines

    assert any(line.startswith(f"!! prepare: {manifest['train_test_overlap']} training problems also occur")
               for line in prepare_lines(manifest))


# The second probe's alterations of a test problem (issue 61, item 3): 6 of 10 such copies were counted.
ALTERATIONS = {  # the first is applied to the test problem that asks about 12000 items
    "thousands separators": lambda q: re.sub(r"\b(\d+)000\b", r"\1,000", q, count=1),
    "upper case": str.upper,
    "lower case": str.lower,
    "swapped case, doubled spaces": lambda q: q.swapcase().replace(" ", "  "),
    "doubled spaces": lambda q: q.replace(" ", "  "),
    "' ?' before the question mark": lambda q: q.replace("?", " ?"),
    "trailing punctuation": lambda q: q + "!!",
    "no punctuation": lambda q: q.replace(".", "").replace("?", ""),
    "tabs and line breaks": lambda q: "\t" + q.replace(". ", ".\n"),
    "full-width question mark": lambda q: q.replace("?", "\uff1f"),
    "a number as 3.0": lambda q: re.sub(r"\b(\d+)\b", r"\1.0", q, count=1),
}


def _altered_copies(tmp_path, micro_cfg) -> dict[str, str]:
    """A test split of 22 problems, one of them asking about 12000 items, and a train split of 40 problems
    holding an altered copy of 11 of them (one per alteration, none held out for validation)."""
    train, test, _ = synthetic.generate(40, 22, seed=5)
    test = [dict(r) for r in test]
    test[0]["question"] = re.sub(r"\b\d+\b", "12000", test[0]["question"], count=1)
    rest, _ = prepare.hold_out(train, 4, micro_cfg["seed"])
    kept = [r["question"] for r in rest]
    copies = {}
    for (name, alter), original, slot in zip(ALTERATIONS.items(), test, kept, strict=False):
        copies[name] = alter(original["question"])
        assert copies[name] != original["question"], name
        next(r for r in train if r["question"] == slot)["question"] = copies[name]
    rows = lambda rs: "".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rs)  # noqa: E731
    (tmp_path / "tr.jsonl").write_text(rows(train))
    (tmp_path / "te.jsonl").write_text(rows(test))
    micro_cfg["data"].update(source="jsonl", train_file=str(tmp_path / "tr.jsonl"),
                             test_file=str(tmp_path / "te.jsonl"), val_examples=4)
    return copies


def test_altered_copies_of_test_problems_are_all_counted(tmp_path, micro_cfg):
    copies = _altered_copies(tmp_path, micro_cfg)
    assert len(copies) == len(ALTERATIONS) == 11
    with pytest.raises(InputError, match=r"^data: 11 training problems also occur in the test split"):
        prepare.run(micro_cfg, tmp_path / "out")
    micro_cfg["data"]["allow_train_test_overlap"] = True
    manifest = prepare.run(micro_cfg, tmp_path / "out")
    assert manifest["train_test_overlap"] == 11
    # each copy is a run of 13 words too; other training problems may share template text with test ones
    assert manifest["train_test_ngram_overlap"]["count"] >= 11


def test_a_shared_run_of_13_words_is_counted_warned_or_refused(tmp_path, micro_cfg, caplog):
    """A training question that contains a test question's first 13 words, and is not that question."""
    train, test, _ = synthetic.generate(40, 22, seed=5)
    long = next(r for r in test if len(contamination.words(r["question"])) >= 16)
    run = " ".join(long["question"].split()[:14])
    rows = [{"question": f"{run} Then it rains. How many are left?", "answer": "#### 1"}]
    rows += [{"question": r["question"], "answer": r["answer"]} for r in train]
    (tmp_path / "tr.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "te.jsonl").write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                                              for r in test))
    micro_cfg["data"].update(source="jsonl", train_file=str(tmp_path / "tr.jsonl"),
                             test_file=str(tmp_path / "te.jsonl"), val_examples=4, max_train=None)
    expected = sum(any(_shares_a_run(contamination.words(r["question"]), contamination.words(t["question"]), 13)
                       for t in test) for r in prepare.hold_out(rows, 4, micro_cfg["seed"])[0])
    assert expected >= 1
    manifest = prepare.run(micro_cfg, tmp_path / "a")
    assert manifest["train_test_overlap"] == 0
    assert manifest["train_test_ngram_overlap"] == {"words": 13, "count": expected, "mode": "count"}
    micro_cfg["data"]["on_ngram_overlap"] = "warn"
    with caplog.at_level("WARNING", logger="rloo.prepare"):
        manifest = prepare.run(micro_cfg, tmp_path / "b")
    assert any(r.getMessage().startswith(f"!!! data: {expected} training problems share a run of 13 words")
               for r in caplog.records)
    from rloo.eval.report import prepare_lines

    assert f"!! prepare: {expected} training problems share a run of 13 words with a test problem " \
           "(data.on_ngram_overlap: warn)" in prepare_lines(manifest)
    micro_cfg["data"]["on_ngram_overlap"] = "error"
    with pytest.raises(InputError, match=rf"^data: {expected} training problems share a run of 13 words .*"
                                         r"data\.on_ngram_overlap: warn or count$"):
        prepare.run(micro_cfg, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    micro_cfg["data"]["ngram_overlap_words"] = 0  # the check off
    assert prepare.run(micro_cfg, tmp_path / "d")["train_test_ngram_overlap"] is None


# -- duplicates within a split (data.on_duplicates), BOM and CRLF (issue 71) ------------------------------
def _normalised(rows: list[dict]) -> list[str]:
    return [contamination.normalised(r["question"]) for r in rows]


def _with_duplicates(tmp_path, micro_cfg) -> None:
    """A train file of 200 distinct problems, 30 exact copies and 10 altered copies (ALTERATIONS: the same
    question once normalised) shuffled among them; a test file of 20 problems and one exact copy."""
    train, test, _ = synthetic.generate(200, 20, seed=3)
    rows = [{"question": r["question"], "answer": r["answer"]} for r in train]
    rng = random.Random(1)
    altered = [{**r, "question": alter(r["question"])}
               for r, alter in zip(rng.sample(rows, 10), list(ALTERATIONS.values())[1:], strict=False)]
    assert len(altered) == 10 and not set(_normalised(altered)) - set(_normalised(rows))
    assert not {r["question"] for r in altered} & {r["question"] for r in rows}
    rows += [dict(r) for r in rng.sample(rows, 30)] + altered
    rng.shuffle(rows)
    test = [{"question": r["question"], "answer": r["answer"]} for r in test]
    lines = lambda rs: "".join(json.dumps(r) + "\n" for r in rs)  # noqa: E731
    (tmp_path / "tr.jsonl").write_text(lines(rows))
    (tmp_path / "te.jsonl").write_text(lines([*test, test[4]]))
    micro_cfg["data"].update(source="jsonl", train_file=str(tmp_path / "tr.jsonl"),
                             test_file=str(tmp_path / "te.jsonl"), val_examples=40)


def test_duplicates_are_counted_dropped_and_never_in_train_and_validation(tmp_path, micro_cfg, caplog):
    """The third fault probe's file (issue 71): repeated lines were kept silently, and 9 of the 40
    validation problems were also training ones."""
    _with_duplicates(tmp_path, micro_cfg)
    with caplog.at_level("INFO", logger="rloo.prepare"):
        manifest = prepare.run(micro_cfg, tmp_path / "drop")
    assert manifest["duplicates"] == {"mode": "drop", "exact": {"train": 30, "test": 1},
                                      "normalised": {"train": 10, "test": 0}}
    assert manifest["counts"] == {"train": 160, "test": 20, "val": 40}
    last = caplog.records[-1].getMessage()
    assert last.startswith("prepared 160 train / 20 test / 40 validation records from jsonl; dropped 41 duplicate"), last
    assert "train 30 exact + 10 normalised, test 1 exact + 0 normalised" in last
    splits = {s: [r for _, r in read_jsonl(tmp_path / "drop" / f"{s}.jsonl")] for s in prepare.SPLITS}
    for split, rows in splits.items():
        assert len(set(_normalised(rows))) == len(rows), split  # one record per question
    assert not set(_normalised(splits["val"])) & set(_normalised(splits["train"]))
    # keep: every record stays, and a question's copies all go to the one side of the validation carve
    micro_cfg["data"]["on_duplicates"] = "keep"
    manifest = prepare.run(micro_cfg, tmp_path / "keep")
    assert manifest["duplicates"]["mode"] == "keep" and manifest["duplicates"]["exact"]["train"] == 30
    kept = {s: [r for _, r in read_jsonl(tmp_path / "keep" / f"{s}.jsonl")] for s in prepare.SPLITS}
    assert len(kept["train"]) + len(kept["val"]) == 240 and len(kept["test"]) == 21
    assert len(set(_normalised(kept["val"]))) == 40 < len(kept["val"])  # copies of validation problems among them
    assert not set(_normalised(kept["val"])) & set(_normalised(kept["train"]))
    # error: one line naming the file and the count; nothing written
    micro_cfg["data"]["on_duplicates"] = "error"
    with pytest.raises(InputError) as e:
        prepare.run(micro_cfg, tmp_path / "error")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'tr.jsonl'}: 40 duplicate records (30 exact copies of an earlier record, 10 "
                          "with an earlier record's question once normalised; first: "), msg
    assert msg.endswith("data.on_duplicates: drop or keep") and "\n" not in msg
    assert not (tmp_path / "error").exists()


def test_a_byte_order_mark_and_crlf_line_ends_prepare_the_same_splits(tmp_path, micro_cfg):
    """A file saved by a Windows editor, or by pandas with encoding="utf-8-sig", is the valid UTF-8 it
    is: the prepared splits are byte for byte those of the plain file; a byte that is not UTF-8 is still
    refused with its line."""
    train, test, _ = synthetic.generate(30, 8, seed=2)
    rows = lambda rs: "".join(json.dumps({"question": r["question"] + " Café?", "answer": r["answer"]},  # noqa: E731
                                         ensure_ascii=False) + "\n" for r in rs)
    variants = {"plain": lambda b: b, "bom": lambda b: codecs.BOM_UTF8 + b,
                "crlf": lambda b: b.replace(b"\n", b"\r\n"),
                "bom+crlf": lambda b: codecs.BOM_UTF8 + b.replace(b"\n", b"\r\n")}
    micro_cfg["data"]["val_examples"] = 5
    made = {}
    for name, encode in variants.items():
        folder = tmp_path / name
        folder.mkdir()
        for split, rs in (("tr", train), ("te", test)):
            (folder / f"{split}.jsonl").write_bytes(encode(rows(rs).encode()))
        micro_cfg["data"].update(source="jsonl", train_file=str(folder / "tr.jsonl"), test_file=str(folder / "te.jsonl"))
        made[name] = prepare.run(micro_cfg, folder / "out")
        assert made[name]["counts"] == {"train": 25, "test": 8, "val": 5}, name
        for split in prepare.SPLITS:
            assert (folder / "out" / f"{split}.jsonl").read_bytes() == \
                (tmp_path / "plain" / "out" / f"{split}.jsonl").read_bytes(), (name, split)
    assert made["bom+crlf"]["sha256"] == made["plain"]["sha256"]
    assert len({m["input_sha256"]["train"] for m in made.values()}) == 4  # the inputs' bytes differ
    # a byte that is not UTF-8, on line 3 of a file with a BOM and CRLF line ends
    bad = tmp_path / "bom+crlf" / "tr.jsonl"
    lines = bad.read_bytes().split(b"\r\n")
    lines[2] = lines[2].replace("Café".encode(), b"Caf\xe9")
    bad.write_bytes(b"\r\n".join(lines))
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}:3: not UTF-8 text \(byte 0xe9 at column \d+\)$"):
        prepare.run(micro_cfg, tmp_path / "bad")
    assert gsm8k.load_jsonl_split(str(bad), on_bad="skip")[1].skipped == 1


def test_a_split_that_differs_from_its_manifest_is_refused_by_every_reader(tmp_path, micro_cfg):
    """A prepare killed after renaming a new train.jsonl into place, before its manifest: the stages
    read the splits through gsm8k.read_split, which holds them to the manifest's SHA-256."""
    from rloo.data.gsm8k import read_split

    prepare.run(micro_cfg, tmp_path)
    assert len(read_split(tmp_path, "train")) == 256
    micro_cfg["seed"] = 1
    new = tmp_path / "new"
    prepare.run(micro_cfg, new)
    (new / "train.jsonl").replace(tmp_path / "train.jsonl")  # the new split beside the old manifest
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'train.jsonl'}: its SHA-256 differs from the one "
                                                   f"{tmp_path / 'manifest.json'} records")):
        read_split(tmp_path, "train")
    assert len(read_split(tmp_path, "test")) == 32  # the splits that still match read as before
    # a stage (the `rloo` command, forked by the tests' stage server): one line, exit 2, before any model
    # is built (the base stage reads the training split)
    res = subprocess.run([str(Path(sys.executable).with_name("rloo")), "base", "-c", str(MICRO), "--set",
                          "tracking.enabled=false", "--data", str(tmp_path), "--out", str(tmp_path / "base")],
                         capture_output=True, text=True, timeout=300)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith(f"rloo base: error: {tmp_path / 'train.jsonl'}: its SHA-256 differs"), \
        res.stderr[-2000:]
    assert not (tmp_path / "base").exists()
    (tmp_path / "manifest.json").unlink()  # a first run killed before its manifest
    with pytest.raises(MissingInputError, match=r"manifest\.json does not exist: `rloo prepare` did not finish"):
        read_split(tmp_path, "test")


def test_a_killed_writers_temporary_file_is_removed_by_the_next_run(tmp_path, micro_cfg):
    """kill -9 while a split is written leaves `.train.jsonl.<host>-<pid>.<random>.tmp`: the next
    write of that file removes it; a live writer's is left alone."""
    from rloo.io import _writer_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # exited: no process of this pid is writing anything
    host = _writer_tag().rsplit("-", 1)[0]
    tmp_path.mkdir(exist_ok=True)
    stale = tmp_path / f".train.jsonl.{host}-{pid}.abc123.tmp"
    stale.write_text('{"question": "half written')
    stale_dir = tmp_path / f".sft.{host}-{pid}.xyz.tmp"  # a killed stage's model folder
    stale_dir.mkdir()
    live = tmp_path / f".test.jsonl.{_writer_tag()}.def456.tmp"  # this process is alive
    live.write_text("")
    prepare.run(micro_cfg, tmp_path)
    assert not stale.exists() and live.exists() and stale_dir.exists()  # only the same output's siblings
    from rloo.io import atomic_dir

    with atomic_dir(tmp_path / "sft") as t:
        (t / "x").write_text("1")
    assert not stale_dir.exists()
