"""Another user of the machine attacks the job's shared memory (issue 22, section 2): see
worker_trust.py for the attacks and what is checked.

The attacker is a second local user, ``cfsdp-attacker`` (a system user without home or
login), made with ``useradd`` the first time and reused afterwards: making it needs root,
as CI has; without root every test here fails saying so (never skips).  One launch at 2
and one at 3 ranks (one segment, ZeRO's shared bucket), and one at 4 for the two-level
segments (two emulated hosts of two ranks).
"""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest

from launcher import run_worker, subtest_filter

ATTACKER = "cfsdp-attacker"
LAUNCH_TIMEOUT_S = 180
SHM_ON = {"CFSDP_IMPL": "c", "CFSDP_SHM": "1", "CFSDP_SHM_SLOT_BYTES": "4096"}


def attacker() -> pwd.struct_passwd:
    """The second user, made if it does not exist yet (idempotent)."""
    if os.geteuid() != 0:
        pytest.fail("test_trust.py needs root: it adds a second local user (useradd) to "
                    "attack the job as, and runs that user's process; run the tests as root "
                    "(as CI does)", pytrace=False)
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        pass
    try:
        r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                            ATTACKER], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.fail("test_trust.py needs useradd (Debian: the passwd package)", pytrace=False)
    if r.returncode not in (0, 9):  # 9: it exists (made meanwhile by another run)
        pytest.fail(f"useradd {ATTACKER} failed ({r.returncode}): {r.stderr}", pytrace=False)
    return pwd.getpwnam(ATTACKER)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,only", [(2, "forged_segment|forged_zero_bucket"),
                                             (3, "forged_segment|forged_zero_bucket"),
                                             (4, "forged_two_level")])
def test_another_user_cannot_get_the_job_to_map_its_file(world_size, only):
    pw = attacker()
    args = subtest_filter() or ["--only", only]
    env = {**SHM_ON, "CFSDP_TEST_ATTACKER_UID": str(pw.pw_uid),
           "CFSDP_TEST_ATTACKER_GID": str(pw.pw_gid), "CFSDP_TEST_ATTACKER_NAME": ATTACKER}
    res = run_worker("worker_trust.py", world_size, args=args, timeout=LAUNCH_TIMEOUT_S,
                     env=env)
    assert "subtests:" in res.output
