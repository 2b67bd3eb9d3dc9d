import os

from django.apps import AppConfig


class CountingConfig(AppConfig):
    name = "bench.counting"
    label = "bench_counting"
    verbose_name = "Benchmark counters"

    def ready(self):
        from bench import counting

        counting.register_job_type()
        if os.environ.get("BENCH_COUNT_URL"):
            counting.install(flush_url=os.environ["BENCH_COUNT_URL"])
