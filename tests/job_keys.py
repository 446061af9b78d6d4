"""The job secrets in-process tests sign with: the job's own, and a stranger's (another secret under the
same job id)."""
from muloco.diloco.auth import JobKey

KEY = JobKey(b"k" * 32, "test-job")
STRANGER_KEY = JobKey(b"x" * 32, "test-job")
