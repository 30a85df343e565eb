"""Where the kernel bake-off's decisions are kept, and when a timing counts (app/cpu/kernel_choice.py): one cache file
per machine, keyed by what changes the answer, read by every replica and restart; one timing at a time; a timing
other work disturbed is not kept; a file this code did not write is timed again."""

import time

import pytest

from app.cpu import kernel_choice
from app.cpu.kernel_choice import BUCKETS, ChoiceCache


def test_a_restart_reading_the_cache_decides_as_the_timing_start_did(tmp_path, monkeypatch):
    from app.cpu.kernel_choice import choose_timed

    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    # a gain of 5.04 us clears the 5 us floor; the cache keeps 0.1 us, where the gain reads 5.0 (in floats, under it)
    times = {bucket.name: {"ours": 7.04e-6, "theirs": 2.0e-6} for bucket in BUCKETS}
    cache = ChoiceCache(tmp_path / "choices.json")
    timed = choose_timed(["shape"], lambda key: times, "ours", "fp32", None, lambda entry: entry is not None, cache)

    def no_timing(key):
        raise AssertionError("a cached decision was timed again")

    restarted = choose_timed(["shape"], no_timing, "ours", "fp32", None, lambda entry: entry is not None,
                             ChoiceCache(cache.path))
    assert restarted == timed


def test_replicas_starting_together_time_one_after_the_other_and_the_second_reads_the_first(tmp_path, monkeypatch):
    """Two timings at once on a 2-core machine each get half of it: both read as disturbed and neither is cached.
    The second waits for the first, then finds the shape in the cache."""
    import threading

    from app.cpu.kernel_choice import choose_timed

    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    times = {bucket.name: {"ours": 9e-6, "theirs": 2e-6} for bucket in BUCKETS}
    running, overlaps, timings = [], [], []

    def timer(key):
        running.append(key)
        overlaps.append(len(running) > 1)
        time.sleep(0.2)
        running.remove(key)
        timings.append(key)
        return times

    decided = []
    replicas = [threading.Thread(target=lambda: decided.append(choose_timed(
        ["shape"], timer, "ours", "fp32", None, lambda entry: entry is not None, ChoiceCache(tmp_path / "choices.json"))))
        for _ in range(2)]
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.join()
    assert timings == ["shape"] and overlaps == [False]
    assert decided[0] == decided[1] == {"shape": dict.fromkeys((b.name for b in BUCKETS), "theirs")}


def test_replicas_saving_together_merge_their_shapes(tmp_path):
    cache = ChoiceCache(tmp_path / "choices.json")
    entry = {"choice": {b.name: "torch" for b in BUCKETS}, "us": {}, "measured": "now"}
    cache.put("machine", "fp32", {"a": entry})
    cache.put("machine", "fp32", {"b": entry})
    assert cache.get("machine", "fp32", "a") == cache.get("machine", "fp32", "b") == entry


def test_the_machine_key_names_the_cpu_by_its_numbers_and_arms_by_implementer_and_part(monkeypatch):
    from app.engine import host_cpus

    epyc = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "fpu avx2 fma avx512f avx512_bf16"}
    monkeypatch.setattr(host_cpus, "cpuinfo_fields", lambda: epyc)
    milan = kernel_choice.machine_key(None)
    assert "model name=AMD EPYC cpu family=25 model=1" in milan and "avx2 fma avx512f avx512_bf16" in milan
    monkeypatch.setattr(host_cpus, "cpuinfo_fields", lambda: {**epyc, "model": "17"})
    assert kernel_choice.machine_key(None) != milan  # another generation under the same name a VM shows
    graviton = {"CPU implementer": "0x41", "CPU part": "0xd40", "Features": "fp asimd sve bf16 i8mm"}
    monkeypatch.setattr(host_cpus, "cpuinfo_fields", lambda: graviton)
    key = kernel_choice.machine_key(None)
    assert "CPU implementer=0x41 CPU part=0xd40" in key and "asimd bf16 i8mm sve" in key


def test_onednns_isa_cap_under_either_prefix_is_part_of_the_machine_key(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    plain = kernel_choice.machine_key(None)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert kernel_choice.machine_key(None) == plain + " | DNNL_MAX_CPU_ISA=AVX512_CORE_BF16"


def test_the_kernels_build_key_covers_flags_given_in_cc(monkeypatch):
    from app.cpu import build

    if build.c_compiler() is None or build.cxx_compiler() is None:
        pytest.skip("no C/C++ compiler on this machine: nothing is built, so nothing is keyed")
    plain = build._build_key()
    monkeypatch.setenv("CC", " ".join(build.c_compiler() + ["-march=x86-64-v3"]))
    assert build._build_key() != plain  # a library built with CC="cc -march=native" elsewhere is not loaded here


def test_machine_options_in_cc_key_the_build_to_this_cpu(monkeypatch):
    """The same CC="cc -march=native" on a CPU with fewer extensions, sharing the cache, must not load the library
    built on the stronger one (it would die on an illegal instruction); without such options the build is portable."""
    from app.cpu import build
    from app.engine import host_cpus

    if build.c_compiler() is None or build.cxx_compiler() is None:
        pytest.skip("no C/C++ compiler on this machine: nothing is built, so nothing is keyed")
    strong = {"model name": "Xeon", "flags": "avx2 fma avx512f avx512_bf16 amx_tile"}
    weak = {"model name": "EPYC", "flags": "avx2 fma"}
    keys = {}
    for cc in ([], ["-march=native"]):
        monkeypatch.setenv("CC", " ".join(build.c_compiler() + cc) if cc else build.c_compiler()[0])
        for name, fields in (("strong", strong), ("weak", weak)):
            monkeypatch.setattr(host_cpus, "cpuinfo_fields", lambda fields=fields: fields)
            monkeypatch.setattr(host_cpus, "cpu_flags", lambda fields=fields: frozenset(fields["flags"].split()))
            keys[bool(cc), name] = build._build_key()
    assert keys[False, "strong"] == keys[False, "weak"]
    assert keys[True, "strong"] != keys[True, "weak"]
    monkeypatch.setattr(host_cpus, "cpuinfo_fields", lambda: {**weak, "cpu MHz": "3012.5"})  # the clock, not the CPU
    assert build._build_key() == keys[True, "weak"]


@pytest.mark.parametrize("content", ["[]", "null", '{"m": []}', '{"m": {"f": {"s": "x"}}}', '{"m": {"f": {"s": {"us": []}}}}',
                                     '{"m": {"f": {"s": {"us": {"1": {}}}}}}', '{"m": {"f": {"s": {"choice": "torch"}}}}'])
def test_a_cache_file_this_code_did_not_write_is_timed_again_not_fatal(tmp_path, monkeypatch, content):
    from app.cpu.kernel_choice import choose_timed

    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr(kernel_choice, "machine_key", lambda build: "m")
    cache = ChoiceCache(tmp_path / "choices.json")
    cache.path.write_text(content)
    times = {bucket.name: {"ours": 2.0, "theirs": 1.0} for bucket in BUCKETS}
    usable = lambda entry: kernel_choice._usable(entry, {"ours": None, "theirs": None})  # noqa: E731
    decided = choose_timed(["s"], lambda key: times, "ours", "f", None, usable, cache)
    assert decided == {"s": {bucket.name: "theirs" for bucket in BUCKETS}}
    assert cache.get("m", "f", "s")["choice"] == decided["s"]  # and written over


def test_a_cpu_quota_below_one_cpu_is_not_taken_for_a_disturbed_timing(tmp_path, monkeypatch):
    from app.cpu.kernel_choice import choose_timed
    from app.engine import host_cpus

    clock = iter([0.0, 1.0])
    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: next(clock))  # one second of timing ...
    cpu = iter([0.0, 0.5])
    monkeypatch.setattr(kernel_choice.time, "process_time", lambda: next(cpu))  # ... with half a CPU's time
    monkeypatch.setattr(kernel_choice.torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(host_cpus, "cgroup_cpu_quota", lambda: 0.5)  # all a 500m pod gets
    times = {bucket.name: {"ours": 2.0, "theirs": 1.0} for bucket in BUCKETS}
    cache = ChoiceCache(tmp_path / "choices.json")
    decided = choose_timed(["s"], lambda key: times, "ours", "f", None, lambda entry: entry is not None, cache)
    assert set(decided["s"].values()) == {"theirs"} and cache.path.exists()


def test_the_kernels_temp_folder_is_this_users_own(tmp_path, monkeypatch):
    """With the cache unwritable, the kernels go to a temp folder of this user's own: a shared one another user can
    write could hold a planted library under the expected name."""
    import os

    from app.cpu import build

    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "no" / "cache")
    (tmp_path / "no").mkdir(mode=0o500)
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path))
    private = tmp_path / f"llm-serve-kernels-{os.getuid()}"
    if os.access(tmp_path / "no", os.W_OK):  # root: permission bits bind nobody, so the cache itself is taken
        assert build._kernel_dirs()[0] == tmp_path / "no" / "cache" / "kernels"
    else:
        assert build._kernel_dirs() == [private] and (private.stat().st_mode & 0o777) == 0o700
    private.mkdir(exist_ok=True)
    private.chmod(0o777)  # another user could write here: never loaded from, never built in
    assert private not in build._kernel_dirs()


def test_a_cache_folder_other_users_can_write_is_never_where_kernels_are_loaded_from(tmp_path, monkeypatch):
    """``LLM_SERVE_CACHE`` may name a shared folder (a team's model cache): its kernels folder, writable by the
    group, could hold a planted library; the kernels then go to this user's own temp folder."""
    import os

    from app.cpu import build

    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "shared")
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / "shared" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o755)
    private = tmp_path / f"llm-serve-kernels-{os.getuid()}"
    assert build._kernel_dirs() == [shared, private]
    shared.chmod(0o775)
    assert build._kernel_dirs() == [private]
    shared.chmod(0o755)
    (tmp_path / "shared").chmod(0o777)  # anyone could swap the kernels folder for their own
    assert build._kernel_dirs() == [private]
    (tmp_path / "shared").chmod(0o755)
    shared.rmdir()
    shared.symlink_to(private)  # a link's target can change between the check and the load
    assert build._kernel_dirs() == [private]


def test_a_library_others_can_write_is_never_loaded(tmp_path, monkeypatch):
    """In a folder that passes, a library file made writable by others (an image build's chmod) is built again."""
    import os

    from app.cpu import build

    monkeypatch.setattr(build, "_kernel_dirs", lambda: [tmp_path])
    monkeypatch.setattr(build, "_build_key", lambda: "k")
    library = tmp_path / "llm_serve_ops-k.so"
    library.write_bytes(b"")
    library.chmod(0o644)
    assert build.build_library() == library  # its own: taken as it is, not built
    library.chmod(0o666)
    built = []
    monkeypatch.setattr(build, "_compile_ops", lambda scratch: built.append("ops") or scratch / "ops.o")
    monkeypatch.setattr(build, "_compile_c", lambda source, scratch: scratch / f"{source.stem}.o")
    monkeypatch.setattr(build, "_run", lambda command: open(command[command.index("-o") + 1], "wb").close())
    monkeypatch.setattr(build, "_torch_link_flags", lambda: [])
    assert build.build_library() == library and built == ["ops"]
    assert not os.stat(library).st_mode & 0o022  # the rebuilt one, written by this user


def test_a_disturbed_timing_keeps_the_incumbent_only_where_it_ran(tmp_path, monkeypatch):
    """An incumbent that fails here is left out of the timing: where the timing is not kept, the fastest that ran
    takes its buckets, never a kernel known to fail."""
    from app.cpu.kernel_choice import choose_timed

    monkeypatch.setattr(kernel_choice.time, "process_time", lambda: 0.0)  # the timing got none of the CPU
    times = {bucket.name: {"dequant-fp32": 4e-5, "dequant-bf16": 3e-5} for bucket in BUCKETS}  # torch-int4 failed
    decided = choose_timed(["s"], lambda key: times, "torch-int4", "f", None, lambda entry: entry is not None,
                           ChoiceCache(tmp_path / "choices.json"))
    assert decided == {"s": dict.fromkeys((bucket.name for bucket in BUCKETS), "dequant-bf16")}
