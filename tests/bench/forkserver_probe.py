"""Run in a fork server's child (and in a fresh process, to compare): facts about the process, as JSON."""

import json
import os
import sys

import torch


def facts(request_json: str) -> None:
    print(json.dumps({"pid": os.getpid(), "threads": torch.get_num_threads(), "request": request_json,
                      "tasks": len(os.listdir("/proc/self/task"))}))


def sleep_forever(pid_path: str) -> None:
    with open(pid_path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_path + ".tmp", pid_path)
    import time

    time.sleep(3600)


if __name__ == "__main__":
    facts(sys.argv[1])
