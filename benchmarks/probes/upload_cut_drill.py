"""One drill: the bench's recovery job at 90 M parameters (1.08 GB of state) on S3, rank 1's node
killed at step 15 once its step-10 shards are uploading. Prints the events that say what the
survivors' abandoned uploads cost the new group."""
import json, sys, time
from elastic.local_cluster import local_cluster
from benchmarks.overhead import connect_with_env
from benchmarks.recovery import elastic_job, model_size, NUM_WORKERS
from elastic.workload import HIDDEN_ENV
from tests.support.seaweedfs import seaweedfs_server
from elastic import Trainer

out = sys.argv[1]
with seaweedfs_server() as s3, local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1) as cluster:
    hidden, params = model_size(90_000_000)
    connect_with_env(cluster, {HIDDEN_ENV: str(hidden)})
    job = elastic_job("elastic", f"{s3.uri}/drill", s3.storage_options, "kill_node", 15)
    job["chaos"][0]["during_upload"] = True
    t0 = time.time()
    result = Trainer(job).fit(progress=False)
    keep = {"fault_injected", "failure_detected", "recovered", "checkpoint_committed", "checkpoint_failed",
            "persist_abandoned", "checkpoint_deferred", "restored", "run_finished", "worker_replaced",
            "silence_detected", "hang_detected"}
    evs = [dict(e, t_rel=round(e["t"] - t0, 2)) for e in result.events if e["kind"] in keep]
    with open(out, "w") as f:
        for e in evs:
            f.write(json.dumps(e) + "\n")
    for e in evs:
        print(e["t_rel"], e["kind"], {k: v for k, v in e.items() if k in ("rank", "step", "persist_s", "error", "recover_s", "source", "lost_steps", "uploading", "ranks", "unanswered_s", "slowest_poll_answer_s")})
    print("total_s", round(time.time() - t0, 1), "params", params)
