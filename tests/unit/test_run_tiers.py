"""tests/run.py's exit status from its runs' pytest statuses."""

from tests.run import NO_TESTS, _combined


def test_the_first_failure_is_the_status_and_a_run_with_nothing_selected_is_no_failure():
    assert _combined(0, 0) == 0
    assert _combined(1, 0) == 1 and _combined(0, 2) == 2 and _combined(3, 1) == 3
    assert _combined(NO_TESTS, 0) == 0 and _combined(0, NO_TESTS) == 0
    assert _combined(NO_TESTS, 1) == 1
    assert _combined(NO_TESTS, NO_TESTS) == NO_TESTS
    assert _combined(0, NO_TESTS, 4) == 4 and _combined(NO_TESTS, NO_TESTS, 0) == 0
    assert _combined(NO_TESTS, NO_TESTS, NO_TESTS) == NO_TESTS
