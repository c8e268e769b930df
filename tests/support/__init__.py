"""What the tests share: fixtures and builders, one module per topic.

Test modules import from here and from the product, never from one another; the fixtures that
tests in several folders use are registered once, by `pytest_plugins` in tests/conftest.py.
tests/test_suite_layout.py keeps it that way."""
