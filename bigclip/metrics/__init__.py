"""What a run measures and where the measurements go. Every logged step is one JSON object in metrics.jsonl,
and goes to tensorboard / wandb when asked for (--report-to); `bigclip report` (report/) draws them.

    meters.py    running averages (AverageMeter) and the peak memory of a device
    trackers.py  ReportConfig (--report-to and what trackers are told) and REPORT_TARGETS: TensorBoard, wandb
    sinks.py     MetricSinks: metrics.jsonl and the trackers, written by the active ranks only
    progress.py  EpochProgress: what the training loop reports about its steps (OpenCLIP's `Train Epoch` line,
                 the step records)
"""
