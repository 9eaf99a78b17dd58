"""Events that start where sentences do (boundary_snap="sentence", preset ES): the vocabulary's sentence edges, the
snap itself on plain tensors, and the engine cutting real prose (the real SmolLM2 tokenizer on a tiny random model)."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig
from emllm.config import ConfigError
from emllm.persistence import load_memory, save_memory
from emllm.segmentation import SentenceEdges, snap_to_sentences

from .tiny import TINY

VOCAB = ["The", " cat", " sat", ".", " Then", " 3", ".", "14", "!\"", "\n", " dog", ". ", "e", " x"]
#         0      1       2       3    4        5     6    7     8      9     10      11    12   13


def _edges():
    return SentenceEdges.from_texts(VOCAB)


def test_a_sentence_starts_after_a_stop_and_a_space_or_after_a_line_end():
    edges = _edges()
    ids = torch.tensor([0, 1, 3, 4, 5, 6, 7, 8, 10, 9, 0, 11, 12, 3, 13])
    #                  The cat .  Then 3 . 14 !"  dog \n The ". " e . x
    starts = edges.starts(ids, previous=None)
    assert [i for i, s in enumerate(starts.tolist()) if s] == [3, 8, 10, 12, 14]
    # " Then" after "." ; " dog" after '!"' ; "The" after "\n" ; "e" after ". " ; " x" after "." -- not "14" after "."
    assert not starts[0]  # nothing before the first token: no sentence edge known there
    assert edges.starts(ids[:1], previous=3).tolist() == [False]  # "The" opens no word with white space
    assert edges.starts(ids[1:2], previous=3).tolist() == [True]  # " cat" after "."


def test_ids_past_the_table_end_nothing_and_start_nothing():
    edges = _edges()
    starts = edges.starts(torch.tensor([3, 500, 4]), previous=None)
    assert starts.tolist() == [False, False, False]


def test_boundaries_move_back_to_their_sentence_start_and_merge():
    sentence_starts = torch.zeros(40, dtype=torch.bool)
    sentence_starts[[10, 25]] = True
    boundaries = torch.tensor([4, 13, 17, 25, 30])
    # 4: before any sentence start -> stays; 13 and 17 -> 10 (one boundary); 25 stays; 30 -> 25 (merged)
    assert snap_to_sentences(boundaries, sentence_starts, reach=16).tolist() == [4, 10, 25]


def test_a_start_farther_back_than_reach_leaves_the_boundary_where_surprise_put_it():
    sentence_starts = torch.zeros(100, dtype=torch.bool)
    sentence_starts[5] = True
    assert snap_to_sentences(torch.tensor([12, 60]), sentence_starts, reach=8).tolist() == [5, 60]
    assert snap_to_sentences(torch.tensor([13]), sentence_starts, reach=8).tolist() == [13]  # 8 back is too far
    assert snap_to_sentences(torch.tensor([], dtype=torch.long), sentence_starts, reach=8).numel() == 0


def test_a_sentence_start_at_zero_is_no_boundary():
    sentence_starts = torch.zeros(20, dtype=torch.bool)
    sentence_starts[0] = True
    assert snap_to_sentences(torch.tensor([3, 15]), sentence_starts, reach=8).tolist() == [15]


def test_boundary_snap_is_checked():
    with pytest.raises(ConfigError, match="boundary_snap"):
        EMConfig(boundary_snap="word")
    assert EMConfig.from_preset("ES").boundary_snap == "sentence"
    assert EMConfig.from_preset("E").boundary_snap == "none"


PROSE = " ".join(
    f"The {colour} lantern of the {place} hangs above door number {number}. Nobody in {town} remembers who lit it "
    f"first, and the keeper writes {number + 7} in her ledger every {day}."
    for colour, place, number, town, day in [
        ("green", "harbour office", 41, "Velmora", "Monday"), ("amber", "old mill", 17, "Dunreath", "Friday"),
        ("violet", "school hall", 93, "Ostrava", "Sunday"), ("crimson", "ferry house", 58, "Kelso", "Tuesday"),
        ("silver", "grain store", 26, "Lund", "Thursday"), ("ochre", "chapel", 71, "Tarbes", "Saturday"),
        ("teal", "bakery", 35, "Girona", "Wednesday"), ("grey", "post office", 64, "Ulm", "Monday"),
    ] * 3)

# Events long enough to hold a sentence of this prose (about 20 tokens), on the tiny layout otherwise.
LAYOUT = {**TINY, "n_local": 64, "n_mem": 96, "max_block_size": 48, "min_block_size": 4, "chunk_size": 32}


def _event_starts(engine, memory):
    """Window-independent starts of every evicted event, and whether each begins a sentence."""
    starts = memory.event_boundaries().tolist()
    ids = torch.tensor(memory.token_ids)
    begins = engine.sentence_edges().starts(ids, previous=None)
    return starts, [bool(begins[s]) for s in starts]


def _read(engine, preset):
    memory = engine.new_memory(EMConfig.from_preset(preset, **LAYOUT))
    engine.read(memory, engine.tokenizer(PROSE)["input_ids"])
    assert memory.num_events > 10
    return memory


def test_es_events_hold_whole_sentences_where_s_cuts_them(smol_engine):
    snapped = _read(smol_engine, "ES")
    starts, begins = _event_starts(smol_engine, snapped)
    sizes = snapped.event_sizes.tolist()
    # Every event begins a sentence, except a cut that enforce_event_sizes made in a sentence longer than the
    # longest event (none here: the prose's sentences are shorter than 48 tokens).
    assert all(begins[1:]), [smol_engine.tokenizer.decode(snapped.token_ids[s:s + 6]) for s, b in zip(starts, begins)
                             if not b]
    assert max(sizes) <= LAYOUT["max_block_size"]
    plain = _read(smol_engine, "S+C")
    assert not all(_event_starts(smol_engine, plain)[1][1:])  # surprise alone cuts inside sentences on this prose


def test_forks_and_loaded_memories_keep_cutting_at_sentences(smol_engine, tmp_path):
    snapped = _read(smol_engine, "ES")
    fork = snapped.fork()
    assert fork.sentence_edges is snapped.sentence_edges
    more = smol_engine.tokenizer(" " + PROSE)["input_ids"][:400]
    smol_engine.read(fork, more)
    assert all(_event_starts(smol_engine, fork)[1][1:])
    save_memory(snapped, tmp_path / "m", engine=smol_engine)
    loaded = load_memory(tmp_path / "m", smol_engine)
    smol_engine.read(loaded, more)
    assert loaded.event_boundaries().tolist() == fork.event_boundaries().tolist()


def test_a_memory_built_without_the_tokenizer_says_how_to_get_its_sentence_edges(smol_engine):
    memory = smol_engine.new_memory(EMConfig.from_preset("ES", **LAYOUT))
    memory.sentence_edges = None
    with pytest.raises(RuntimeError, match=r"EMEngine\.new_memory"):
        smol_engine.read(memory, smol_engine.tokenizer(PROSE)["input_ids"])
