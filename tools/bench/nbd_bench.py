#!/usr/bin/env python3
# Helpers of tools/bench/run-nbd-bench and tools/bench/ab-dedupd-builds:
#   phase FIO_JSON META_JSON CPU0 CPU1 CLK_TCK WALL   one phase record (JSON line) from fio's JSON
#   summary PHASES OUT_DIR REPS META_JSON               the markdown tables and nbd-summary.json
#   hold SOCK EXPORT READY_FILE                         an idle NBD client holding EXPORT open
#   ab-summary SLICES_FILE [BASE [NAME...]]             medians of ab-dedupd-builds' slices
import json, os, statistics, sys

def fio_phase(argv):
    fio_json, meta_json, cpu0, cpu1, tck, wall = argv
    j = json.load(open(fio_json))
    job = j["jobs"][0]
    if job.get("error"):
        sys.exit("fio job error %s" % job["error"])
    meta = json.loads(meta_json)
    d = job["read"] if job["read"]["io_bytes"] else job["write"]
    pct = d["clat_ns"].get("percentile", {})
    rec = dict(meta)
    rec.update(
        bw_mb_s=d["bw_bytes"] / 1e6,
        iops=d["iops"],
        io_bytes=d["io_bytes"],
        runtime_ms=d["runtime"],
        clat_p50_us=pct.get("50.000000", 0) / 1e3,
        clat_p99_us=pct.get("99.000000", 0) / 1e3,
        fio_cpu_pct=job["usr_cpu"] + job["sys_cpu"],
        wall_s=float(wall),
    )
    if cpu0 != "":
        cpu = (int(cpu1) - int(cpu0)) / int(tck)
        rec["dedupd_cpu_s"] = cpu
        rec["dedupd_cpu_s_per_gib"] = cpu / (d["io_bytes"] / 2**30) if d["io_bytes"] else 0
        rec["dedupd_cpu_util"] = cpu / (d["runtime"] / 1e3) if d["runtime"] else 0
    print(json.dumps(rec))
    extra = ""
    if "dedupd_cpu_s" in rec:
        extra = "  dedupd %.2f CPU s (%.0f%% of a CPU, %.2f s/GiB)" % (
            rec["dedupd_cpu_s"], 100 * rec["dedupd_cpu_util"], rec["dedupd_cpu_s_per_gib"])
    sys.stderr.write("  %-8s %-26s %-4s rep %d: %8.1f MB/s %8.0f IOPS  p50 %6.0f us  p99 %6.0f us%s\n" % (
        rec["section"], rec["label"], rec["side"], rec["rep"], rec["bw_mb_s"], rec["iops"],
        rec["clat_p50_us"], rec["clat_p99_us"], extra))

def med(v):
    return statistics.median(v) if v else float("nan")

def summary(argv):
    phases_path, out_dir, reps, meta_json = argv
    reps = int(reps)
    meta = json.loads(meta_json)
    recs = [json.loads(l) for l in open(phases_path) if l.strip()]
    out = {"meta": meta, "monitor": [], "direct": [], "hash": None}
    lines = []
    def rows_of(section):
        seen = []
        for r in recs:
            if r["section"] == section and r["workload"] not in seen:
                seen.append(r["workload"])
        return seen
    def get(section, workload, side):
        return sorted((r for r in recs if r["section"] == section and r["workload"] == workload
                       and r["side"] == side), key=lambda r: r["rep"])

    # ---- 1. write monitor on vs off
    # One record per pair and side: a pair's slices (fio runs alternating
    # between the two dedupds) summed, bytes over time.
    def per_rep(rs):
        groups = {}
        for r in rs:
            groups.setdefault(r["rep"], []).append(r)
        merged = []
        for rep in sorted(groups):
            g = groups[rep]
            b = sum(r["io_bytes"] for r in g)
            t = sum(r["runtime_ms"] for r in g) / 1e3
            cpu = sum(r.get("dedupd_cpu_s", 0) for r in g)
            m = dict(g[0])
            m.update(slices=len(g), io_bytes=b, runtime_ms=t * 1e3,
                     bw_mb_s=b / t / 1e6 if t else 0,
                     iops=sum(r["iops"] * r["runtime_ms"] for r in g) / (t * 1e3) if t else 0,
                     dedupd_cpu_s=cpu,
                     dedupd_cpu_s_per_gib=cpu / (b / 2**30) if b else 0,
                     dedupd_cpu_util=cpu / t if t else 0,
                     idle_side_cpu_s=sum(r.get("idle_side_cpu_s", 0) for r in g),
                     slice_mb_s=[r["bw_mb_s"] for r in sorted(g, key=lambda r: r.get("slice", 0))])
            merged.append(m)
        return merged
    mon_rows = []
    for section in ("first", "monitor", "sha256", "iscsi_monitor"):
        for w in rows_of(section):
            on, off = per_rep(get(section, w, "on")), per_rep(get(section, w, "off"))
            n = min(len(on), len(off))
            if n == 0:
                continue
            pairs = [on[i]["bw_mb_s"] / off[i]["bw_mb_s"] for i in range(n) if off[i]["bw_mb_s"] > 0]
            cpu_on = [r["dedupd_cpu_s_per_gib"] for r in on[:n]]
            cpu_off = [r["dedupd_cpu_s_per_gib"] for r in off[:n]]
            mon_cost = [cpu_on[i] - cpu_off[i] for i in range(n)]
            row = {
                "section": section, "workload": w, "label": on[0]["label"], "hash": on[0]["hash"],
                "where": on[0].get("where", "local file"), "pinned": on[0].get("pinned", 0),
                "bs": on[0]["bs"], "iodepth": on[0]["iodepth"],
                "on_median_mb_s": med([r["bw_mb_s"] for r in on[:n]]),
                "off_median_mb_s": med([r["bw_mb_s"] for r in off[:n]]),
                "on_median_iops": med([r["iops"] for r in on[:n]]),
                "off_median_iops": med([r["iops"] for r in off[:n]]),
                "pair_ratios": pairs, "ratio": med(pairs),
                "dedupd_cpu_s_per_gib_on": med(cpu_on), "dedupd_cpu_s_per_gib_off": med(cpu_off),
                "monitor_cpu_s_per_gib_pairs": mon_cost, "monitor_cpu_s_per_gib": med(mon_cost),
                "dedupd_cpu_util_on": med([r["dedupd_cpu_util"] for r in on[:n]]),
                "dedupd_cpu_util_off": med([r["dedupd_cpu_util"] for r in off[:n]]),
                # The on side's dedupd while the off side's slices ran (its
                # flusher may append then), and the reverse; CPU s per pair.
                "on_cpu_s_in_off_slices": med([r["idle_side_cpu_s"] for r in off[:n]]),
                "off_cpu_s_in_on_slices": med([r["idle_side_cpu_s"] for r in on[:n]]),
                "on": on[:n], "off": off[:n],
            }
            if section in ("monitor", "sha256", "iscsi_monitor") and w == "seq_write_64k":
                row["target"] = "loss <= 5% (on/off >= 0.95)"
                row["target_met"] = row["ratio"] >= 0.95
            mon_rows.append(row)
    out["monitor"] = mon_rows
    if mon_rows:
        lines.append("### 1. Write monitor on vs off (fio over NBD, iodepth %s, dedupd --threads %s, %s; "
                     "in place: each pair %d x %d s per side, alternating between the two dedupds)"
                     % (meta["iodepth"], meta["threads"],
                        "fio on CPU 0, dedupd on CPU 1" if meta.get("pin") else "not pinned",
                        meta.get("slices", 1), meta.get("slice_seconds", 0)))
        lines.append("")
        lines.append("| workload | volume | hash | off MB/s | on MB/s | off IOPS | on IOPS | **on/off** | per pair | dedupd CPU s/GiB off | on | monitor CPU s/GiB (on - off) | dedupd CPU use off / on | idle side's CPU s per pair: on in off slices / off in on slices |")
        lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |")
        for r in mon_rows:
            lines.append("| %s | %s | %s | %.1f | %.1f | %.0f | %.0f | **%.1f%%** | %s | %.2f | %.2f | %.2f | %.0f%% / %.0f%% | %.2f / %.2f |" % (
                r["label"], r["where"], r["hash"], r["off_median_mb_s"], r["on_median_mb_s"],
                r["off_median_iops"], r["on_median_iops"], 100 * r["ratio"],
                " ".join("%.2f" % x for x in r["pair_ratios"]),
                r["dedupd_cpu_s_per_gib_off"], r["dedupd_cpu_s_per_gib_on"], r["monitor_cpu_s_per_gib"],
                100 * r["dedupd_cpu_util_off"], 100 * r["dedupd_cpu_util_on"],
                r["on_cpu_s_in_off_slices"], r["off_cpu_s_in_on_slices"]))
        lines.append("")

    # ---- 2. hash
    try:
        h = json.load(open(out_dir + "/nbd-hash.json"))
        out["hash"] = h
        lines.append("### 2. Fingerprint CPU cost (dede-bench-hash, 4 KiB blocks, median of %d)" % h["reps"])
        lines.append("")
        lines.append("| hash | buffer | CPU s/GiB | GB/s per CPU second |")
        lines.append("| --- | --- | ---: | ---: |")
        for algo, bufs in h["results"].items():
            for name, r in bufs.items():
                size = r["buffer_bytes"]
                sz = "%d MiB" % (size >> 20) if size >= 1 << 20 else "%d KiB" % (size >> 10)
                lines.append("| %s | %s (%s) | %.3f | %.2f |" % (algo, name, sz, r["cpu_seconds_per_gib"], r["gb_per_cpu_second"]))
        lines.append("")
    except FileNotFoundError:
        pass

    # ---- 3. NBD vs direct (and 5. the same over iSCSI)
    def nbd_vs_direct(section, prefix, heading, where):
        rows = []
        direct = []
        for i in range(1, reps + 1):
            try:
                direct.append(json.load(open("%s/%s-rep%d.json" % (out_dir, prefix, i))))
            except FileNotFoundError:
                direct.append(None)
        for w in rows_of(section):
            nbd = get(section, w, "nbd")
            if not nbd:
                continue
            key = nbd[0]["direct_key"]
            dv, rv, pairs, rawpairs = [], [], [], []
            for r in nbd:
                d = direct[r["rep"] - 1] if r["rep"] - 1 < len(direct) else None
                if not d or key not in d["workloads"]:
                    continue
                v = d["workloads"][key]["volume"][0]["mb_per_s"]
                raw = d["workloads"][key]["raw"][0]["mb_per_s"]
                dv.append(v); rv.append(raw)
                pairs.append(r["bw_mb_s"] / v if v else 0)
                rawpairs.append(r["bw_mb_s"] / raw if raw else 0)
            row = {
                "workload": w, "label": nbd[0]["label"], "bs": nbd[0]["bs"], "iodepth": nbd[0]["iodepth"],
                "where": where, "direct_key": key, "nbd_median_mb_s": med([r["bw_mb_s"] for r in nbd]),
                "nbd_median_iops": med([r["iops"] for r in nbd]),
                "direct_median_mb_s": med(dv), "raw_median_mb_s": med(rv),
                "pair_ratios": pairs, "ratio": med(pairs), "nbd_over_raw": med(rawpairs),
                "dedupd_cpu_util": med([r["dedupd_cpu_util"] for r in nbd]),
                "nbd": nbd,
            }
            if w.startswith("seq_") and nbd[0]["iodepth"] == 1 and not w.endswith("_nora"):
                row["target"] = ">= 70% of direct"
                row["target_met"] = row["ratio"] >= 0.70
            rows.append(row)
        if rows:
            lines.append(heading)
            lines.append("")
            lines.append("| workload | NBD iodepth | direct MB/s | NBD MB/s | NBD IOPS | **NBD/direct** | per pair | NBD/raw | dedupd CPU use |")
            lines.append("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
            for r in rows:
                lines.append("| %s | %d | %.1f | %.1f | %.0f | **%.1f%%** | %s | %.1f%% | %.0f%% |" % (
                    r["label"], r["iodepth"], r["direct_median_mb_s"], r["nbd_median_mb_s"], r["nbd_median_iops"],
                    100 * r["ratio"], " ".join("%.2f" % x for x in r["pair_ratios"]), 100 * r["nbd_over_raw"],
                    100 * r["dedupd_cpu_util"]))
            lines.append("")
        return rows
    drows = nbd_vs_direct("direct", "nbd-direct",
                          "### 3. NBD vs direct volume I/O, local file (direct: dede-bench-volume, QD1; NBD: fio, write monitor on)",
                          "local file")
    out["direct"] = drows

    ceiling_path = out_dir + "/nbd-ceiling.json"
    if os.path.exists(ceiling_path):
        c = json.load(open(ceiling_path))
        out["ceiling"] = c
        lines.append("### 4. Socket ceiling at QD1 (dede-bench-socket-ceiling, same file, %d KiB requests)" % (c["request_bytes"] >> 10))
        lines.append("")
        lines.append("| workload | direct MB/s | least server MB/s | **server/direct** | per rep | dedupd's NBD/direct (section 3) |")
        lines.append("| --- | ---: | ---: | ---: | --- | ---: |")
        qd1 = {r["workload"]: r for r in drows if r["iodepth"] == 1}
        for label, key, dkey, wl in (("seq write 1M, serial server", "write_serial_Bps", "write_direct_Bps", "seq_write_1m_qd1"),
                                     ("seq write 1M, overlapped server (%d pieces)" % c["pieces"], "write_overlapped_Bps", "write_direct_Bps", "seq_write_1m"),
                                     ("seq read 1M, serial server", "read_serial_Bps", "read_direct_Bps", "seq_read_1m_qd1"),
                                     ("seq read 1M, overlapped server (%d pieces)" % c["pieces"], "read_overlapped_Bps", "read_direct_Bps", "seq_read_1m")):
            if key not in c["reps"][0]:
                continue  # a ceiling file from before the overlapped write server
            ratios = [r[key] / r[dkey] for r in c["reps"]]
            dmed = statistics.median(r[dkey] for r in c["reps"]) / 1e6
            smed = statistics.median(r[key] for r in c["reps"]) / 1e6
            ours = qd1.get(wl)
            lines.append("| %s | %.1f | %.1f | **%.1f%%** | %s | %s |" % (
                label, dmed, smed, 100 * statistics.median(ratios), " ".join("%.2f" % x for x in ratios),
                "%.1f%%" % (100 * ours["ratio"]) if ours else "-"))
        lines.append("")

    irows = nbd_vs_direct("iscsi", "nbd-iscsi-direct",
                          "### 5. NBD vs direct volume I/O over iSCSI (tgtd on 127.0.0.1; direct: dede-bench-volume, QD1; NBD: fio, write monitor on)",
                          "iSCSI")
    out["iscsi"] = irows

    # ---- targets
    lines.append("### Targets")
    lines.append("")
    lines.append("| target | measured | met |")
    lines.append("| --- | --- | --- |")
    for r in mon_rows:
        if "target" in r:
            odd = " (on faster than off: look for an artifact)" if r["ratio"] > 1.05 else ""
            lines.append("| seq 64K write loss with the monitor on (%s, %s) <= 5%% | on/off %.1f%% (loss %.1f%%)%s | %s |" % (
                r["hash"], r["where"], 100 * r["ratio"], 100 * (1 - r["ratio"]), odd, "yes" if r["target_met"] else "**no**"))
    for r in drows + irows:
        if "target" in r:
            lines.append("| %s over NBD >= 70%% of direct (%s) | %.1f%% | %s |" % (
                r["label"], r["where"], 100 * r["ratio"], "yes" if r["target_met"] else "**no**"))
    out["markdown"] = "\n".join(lines)
    json.dump(out, open(out_dir + "/nbd-summary.json", "w"), indent=2)
    print("\n".join(lines))

def hold(argv):
    # An idle NBD client of one export (fixed newstyle handshake, NBD_OPT_GO),
    # like a running VM's: dedupd keeps the export open while it is
    # connected. Creates READY_FILE once the export is open; on SIGTERM
    # sends NBD_CMD_DISC and exits.
    import signal, socket, struct
    path, name, ready_file = argv
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    def recv(n):
        b = b""
        while len(b) < n:
            c = s.recv(n - len(b))
            if not c:
                sys.exit("hold: dedupd closed the connection")
            b += c
        return b
    hello = recv(18)
    if hello[:16] != b"NBDMAGICIHAVEOPT":
        sys.exit("hold: not a fixed newstyle NBD server")
    s.sendall(struct.pack(">I", 1 | 2))  # FIXED_NEWSTYLE | NO_ZEROES
    n = name.encode()
    s.sendall(b"IHAVEOPT" + struct.pack(">II", 7, 4 + len(n) + 2) + struct.pack(">I", len(n)) + n +
              struct.pack(">H", 0))
    while True:
        magic, opt, typ, length = struct.unpack(">QIII", recv(20))
        data = recv(length)
        if typ & (1 << 31):
            sys.exit("hold: NBD_OPT_GO %s failed: %s" % (name, data[4:].decode(errors="replace") if len(data) > 4 else data))
        if typ == 1:  # NBD_REP_ACK
            break
    def disc(*_):
        s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, 0, 0, 0))
        s.close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, disc)
    open(ready_file, "w").write("ready\n")
    while True:
        signal.pause()

def ab_summary(argv):
    # Lines "ROUND SLICE NAME IO_BYTES RUNTIME_MS CPU_TICKS CLK_TCK" from
    # ab-dedupd-builds: per build and round, bytes over time of its slices;
    # the median over rounds of its ratio to BASE's (default: the last build
    # seen). NAMEs: the builds to print, in that order.
    rows = [l.split() for l in open(argv[0]) if l.strip() and l[0].isdigit()]
    names, rounds = [], {}
    for rnd, _, name, b, t, c, tck in rows:
        if name not in names:
            names.append(name)
        a = rounds.setdefault(rnd, {}).setdefault(name, [0, 0, 0.0])
        a[0] += int(b)
        a[1] += int(t)
        a[2] += int(c) / int(tck)
    base = argv[1] if len(argv) > 1 else names[-1]
    if len(argv) > 2:  # the builds in the order given
        names = [n for n in argv[2:] if n in names]
    if base not in names:
        sys.exit("ab-summary: no build named %s" % base)
    print("| build | vs %s: median | per round | MB/s median | CPU s/GiB median |" % base)
    print("| --- | ---: | --- | ---: | ---: |")
    for name in names:
        ratios, mbs, cpus = [], [], []
        for rnd in sorted(rounds, key=int):
            a, o = rounds[rnd].get(name), rounds[rnd].get(base)
            if not a or not o or not a[1] or not o[1] or not o[0]:
                continue
            ratios.append((a[0] / a[1]) / (o[0] / o[1]))
            mbs.append(a[0] / a[1] / 1e3)
            cpus.append(a[2] / (a[0] / 2**30) if a[0] else 0)
        print("| %s | **%.3f** | %s | %.1f | %.3f |" % (name, med(ratios), " ".join("%.2f" % x for x in ratios),
                                                    med(mbs), med(cpus)))

{"phase": fio_phase, "summary": summary, "hold": hold, "ab-summary": ab_summary}[sys.argv[1]](sys.argv[2:])
