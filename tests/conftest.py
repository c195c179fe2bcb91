"""The test kit's own asserts (testkit/: the machine driver, the stand-in launcher, the rigs)
report their values as a test's asserts do."""

import pytest

pytest.register_assert_rewrite("testkit")
