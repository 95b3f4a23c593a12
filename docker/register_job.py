"""One-shot step (compose, Kubernetes, Slurm): register a job with the service and write its id and
worker token for the agents.

python docker/register_job.py URL JOB.json OUT.env [MAX_FAILURES]   (controller token from
RECYCLE_CONTROLLER_TOKEN; MAX_FAILURES, default 1: the service plans every failure set of up to that
many workers ahead)
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid


def main() -> int:
    """POST /v1/jobs and write RECYCLE_JOB_ID / RECYCLE_WORKER_TOKEN lines to OUT.env."""
    url, job_path, out_path = sys.argv[1:4]
    max_failures = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    with open(job_path) as f:
        body = json.dumps({"job": json.load(f), "max_failures": max_failures}).encode()
    req = urllib.request.Request(
        f"{url}/v1/jobs",
        data=body,
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['RECYCLE_CONTROLLER_TOKEN']}",
            # one key for every attempt: a retry after a lost answer gets the same job, not a second
            "Idempotency-Key": str(uuid.uuid4()),
        },
    )
    for attempt in range(5):
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                created = json.load(resp)
            break
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, TimeoutError) as exc:
            if attempt == 4:
                raise
            print(f"register: {exc}; retrying", file=sys.stderr)
            time.sleep(2**attempt)
    with open(out_path, "w") as f:
        f.write(f"RECYCLE_JOB_ID={created['id']}\nRECYCLE_WORKER_TOKEN={created['worker_token']}\n")
    print(f"registered job {created['id']} (version {created['version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
