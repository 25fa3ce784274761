"""Limit tokens on RabbitMQ, the pure part: names, which limits apply, one worker's book."""

from __future__ import annotations

import pytest

from celery_fair.keys.limits import CONCURRENCY, RATE, KeyLimits
from celery_fair.keys.tokens import HeldToken, TokenBook, TokenSpec, token_specs


def test_a_keys_own_limit_wins_over_the_default_and_rates_become_windows() -> None:
    limits = KeyLimits(concurrency={"*": 2, "gold": 8}, rates={"free": 5.0, "*": 0.5})
    gold = token_specs(limits, "jobs", "gold")
    assert [(s.kind, s.count, s.period) for s in gold] == [(CONCURRENCY, 8, 0.0), (RATE, 1, 2.0)]
    free = token_specs(limits, "jobs", "free")
    assert [(s.kind, s.count, s.period) for s in free] == [(CONCURRENCY, 2, 0.0), (RATE, 5, 1.0)]
    assert token_specs(KeyLimits(concurrency={"gold": 1}), "jobs", "other") == ()


def test_names_carry_the_limit_so_a_changed_limit_is_a_new_set() -> None:
    two, three = TokenSpec("jobs", "k", CONCURRENCY, 2), TokenSpec("jobs", "k", CONCURRENCY, 3)
    assert two.name != three.name and two.name.startswith("jobs.fair.t.c2.")
    rate = TokenSpec("jobs", "k", RATE, 5, 1.0)
    assert rate.name.startswith("jobs.fair.t.r5p1000.")
    assert {rate.wait, rate.marker, rate.mint_lock} == {
        rate.name + ".wait",
        rate.name + ".minted",
        rate.name + ".mint",
    }
    # Any key text gives a valid queue name (a digest, not the key).
    long_key = TokenSpec("jobs", "x" * 1000 + " é/#", CONCURRENCY, 1)
    assert len(long_key.name) < 64


def test_tasks_aside_leave_in_order_per_key_and_keys_take_turns() -> None:
    book: TokenBook[str] = TokenBook()
    for task in ("a1", "a2", "a3"):
        book.put_aside("q", "a", task)
    book.put_aside("q", "b", "b1")
    assert book.waiting("q", "a") and book.aside_count() == 4
    assert book.keys_aside() == [("q", "a"), ("q", "b")]
    assert book.next_aside("q", "a") == "a1"
    # "a" goes to the back of the line of keys waiting.
    assert book.keys_aside() == [("q", "b"), ("q", "a")]
    assert book.next_aside("q", "b") == "b1" and not book.waiting("q", "b")
    assert book.next_aside("q", "b") is None
    assert book.drop_aside(lambda t: t != "a3") == ["a3"]
    assert list(book) == ["a2"] and book.aside_by_key() == {"a": 1}


def test_held_tokens_are_released_once_and_a_lost_channel_forgets_its_own() -> None:
    spec = TokenSpec("q", "k", CONCURRENCY, 2)
    book: TokenBook[str] = TokenBook()
    book.hold("t1", [HeldToken(spec, 1, generation=1)])
    book.hold("t2", [HeldToken(spec, 2, generation=2)])
    assert book.held_by_key() == {"k": 2} and book.holders() == ["t1", "t2"]
    assert book.held_tasks() == 2
    assert book.forget_generation(1) == 1
    assert book.release("t1") == [] and book.holders() == ["t2"]
    (token,) = book.release("t2")
    assert token.tag == 2 and book.release("t2") == [] and book.held_count() == 0
    assert book.taken == 2


@pytest.mark.parametrize(
    ("rate", "window"),
    [(50.0, (50, 1.0)), (1.0, (1, 1.0)), (0.1, (1, 10.0)), (100_000.0, (100, 0.001))],
)
def test_a_rate_is_tokens_over_a_period(rate: float, window: tuple[int, float]) -> None:
    (spec,) = token_specs(KeyLimits(rates={"*": rate}), "q", "k")
    assert (spec.count, spec.period) == pytest.approx(window)
