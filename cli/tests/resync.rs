//! A stale copy heals itself online, the whole stack in one process: the
//! control plane with its heal loop, two real targets (file devices), and a
//! host serving the volume as the agent does (volume engine +
//! the copy watcher), writing throughout; then `nvpool volume verify`
//! finds the copies equal, and finds a region changed behind their back.

mod common;

use common::{control_plane_with, file_range, target, ADMIN, HOST, MIB};
use nvpool_cli::client::Client;
use nvpool_cli::verify::{verify, VerifyOptions};
use nvpool_initiator::device::block_on;
use nvpool_initiator::volume::CopyState;
use nvpool_testkit::{pattern, wait_for};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Extents of 4 MiB: four resync regions each.
const EXTENT: u64 = 4 * MIB;

#[test]
fn a_stale_copy_heals_partially_while_the_host_writes() {
    let (cp, cluster) = control_plane_with(EXTENT);
    // Replacement never comes into it: the target comes back.
    let (stop, healer) = common::healer(&cluster, 600_000);
    let mut targets = [target(&cp, "t0"), target(&cp, "t1")];
    let client = Client::new(&format!("http://{}", cp.addr), Some(ADMIN.into())).unwrap();

    // A two-copy raid1 of two rows.
    let uuid = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42";
    let body = json!({"name": "heal", "size_bytes": 2 * EXTENT,
                      "layout": {"type": "raid1", "copies": 2}});
    let (_, v): (u16, Value) = client.put(&format!("/v1/volumes/{uuid}"), &body).unwrap();
    // The victim: the target of copy 1 of row 0.
    let vi = usize::from(v["extents"][1]["target"] == "t1");
    let on_victim: Vec<usize> = (0..4)
        .filter(|&i| v["extents"][i]["target"] == targets[vi].id.as_str())
        .collect();
    let base = format!(
        "/v1/volumes/{uuid}/attachments/{}",
        nvpool_cli::client::segment(HOST)
    );
    // Serve it as the agent does.
    let common::Served { volume, watching } = common::serve(&client, uuid, &stop);

    // Pattern A everywhere.
    let vol_bytes = 2 * EXTENT as usize;
    let (r, _) = block_on(volume.write(0, pattern(1, vol_bytes), false));
    r.unwrap();

    // The copies' target dies; the host writes region 1 of row 0 and
    // region 2 of row 1 and gives the copies up.
    targets[vi].stop();
    let b = pattern(2, MIB as usize);
    let (r, _) = block_on(volume.write(MIB, b.clone(), false));
    r.unwrap();
    let (r, _) = block_on(volume.write(EXTENT + 2 * MIB, b.clone(), false));
    r.unwrap();
    let failed = volume.health().failed_extents;
    assert_eq!(
        failed, on_victim,
        "every copy on the dead target is given up"
    );
    let (_, _): (u16, Value) = client
        .put(
            &format!("{base}/failed-extents"),
            &json!({"failed_extents": failed}),
        )
        .unwrap();
    let v: Value = client.get(&format!("/v1/volumes/{uuid}")).unwrap();
    assert_eq!(v["status"], "degraded");
    let metric = |name: &str| -> u64 {
        let text = ureq::get(format!("http://{}/metrics", cp.addr))
            .header("Authorization", format!("Bearer {ADMIN}"))
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert_eq!(metric("nvpool_stale_extents "), on_victim.len() as u64);

    // A writer keeps going while the target comes back and the copies heal.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (volume, writing) = (volume.clone(), writing.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while writing.load(Ordering::Relaxed) {
                // Region 0 of row 1, rewritten over and over.
                let (r, _) = block_on(volume.write(
                    EXTENT + (n % 16) * 64 * 1024,
                    pattern(n, 64 * 1024),
                    false,
                ));
                r.unwrap();
                n += 1;
            }
            n
        })
    };
    targets[vi].restart(&cp);
    wait_for("the copies to be in sync", Duration::from_secs(60), || {
        let v: Value = client.get(&format!("/v1/volumes/{uuid}")).unwrap();
        v["failed_extents"] == json!([]) && v["copy_jobs"] == json!([])
    });
    wait_for(
        "the host to read the copies again",
        Duration::from_secs(10),
        || (0..4).all(|i| volume.copy_state(i) == CopyState::Ok),
    );
    writing.store(false, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(writes > 0);
    block_on(volume.flush()).unwrap();

    // Partial: only the regions written while the copies were away (plus
    // what the writer touched before it was mirroring).
    let h: Vec<Value> = client.get(&format!("/v1/volumes/{uuid}/history")).unwrap();
    assert!(!h.is_empty());
    for r in &h {
        assert_eq!(r["result"], "done", "{r}");
        assert_eq!(r["kind"], "resync-partial", "{r}");
    }
    let copied: u64 = h.iter().map(|r| r["bytes_copied"].as_u64().unwrap()).sum();
    assert!(
        copied >= 2 * MIB,
        "at least the two regions written: {copied}"
    );
    assert!(
        copied <= 4 * MIB,
        "far less than the 8 MiB the copies hold: {copied}"
    );
    assert_eq!(metric("nvpool_stale_extents "), 0);
    assert_eq!(metric("nvpool_copies_running "), 0);
    assert_eq!(metric("nvpool_copy_bytes "), copied);

    // Both copies of each row are byte-identical on the devices.
    let v: Value = client.get(&format!("/v1/volumes/{uuid}")).unwrap();
    for row in 0..2 {
        let e0 = &v["extents"][row * 2];
        let e1 = &v["extents"][row * 2 + 1];
        let dev = |e: &Value| targets[usize::from(e["target"] == "t1")].device_path();
        let a = file_range(&dev(e0), e0["offset"].as_u64().unwrap(), EXTENT);
        let b = file_range(&dev(e1), e1["offset"].as_u64().unwrap(), EXTENT);
        assert!(a == b, "row {row}: the copies differ");
    }
    // `nvpool volume verify` agrees, online (the host still has it
    // attached)...
    let opts = VerifyOptions::default();
    let report = verify(&client, &uuid.parse().unwrap(), &opts).unwrap();
    assert_eq!(report.copies_compared, 4, "{report:?}");
    assert_eq!(report.bytes_read, 4 * EXTENT);
    assert!(report.differences.is_empty(), "{report:?}");
    // ...and finds one region of one copy changed behind the volume's back.
    {
        use std::os::unix::fs::FileExt;
        let e = &v["extents"][3];
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(targets[usize::from(e["target"] == "t1")].device_path())
            .unwrap();
        f.write_all_at(
            &[0xEE; 4096],
            e["offset"].as_u64().unwrap() + 2 * MIB + 8192,
        )
        .unwrap();
        f.sync_data().unwrap();
    }
    let report = verify(&client, &uuid.parse().unwrap(), &opts).unwrap();
    assert_eq!(report.differences.len(), 1, "{report:?}");
    let d = &report.differences[0];
    assert_eq!(
        (d.row, d.region, d.offset, d.length),
        (1, 2, 2 * MIB, MIB),
        "{d:?}"
    );
    assert_eq!(d.extents, vec![2, 3]);
    let a: Value = client
        .get(&format!("/v1/volumes/{uuid}/attachments"))
        .unwrap();
    assert_eq!(
        a.as_array().unwrap().len(),
        1,
        "the verifier's attachment is gone: {a}"
    );

    // Repair: `nvpool volume resync --extent 3 --wait` marks the copy stale;
    // the host stops reading it, and it is copied whole while attached.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, ADMIN).unwrap();
    let nvpool = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_nvpool"))
            .env_remove("NVPOOL_LOG")
            .env("NVPOOL_ENDPOINT", format!("http://{}", cp.addr))
            .env("NVPOOL_TOKEN_FILE", &token)
            .args(args)
            .output()
            .unwrap()
    };
    let out = nvpool(&[
        "volume", "resync", uuid, "--extent", "3", "--wait", "-o", "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(after["failed_extents"], json!([]), "{after}");
    let h: Vec<Value> = client.get(&format!("/v1/volumes/{uuid}/history")).unwrap();
    assert_eq!(h[0]["extent"], 3);
    assert_eq!(h[0]["kind"], "resync-full");
    assert_eq!(h[0]["result"], "done");
    let report = verify(&client, &uuid.parse().unwrap(), &opts).unwrap();
    assert!(report.differences.is_empty(), "repaired: {report:?}");
    // While one copy of a row is stale, the other is the last in sync.
    let out = nvpool(&["volume", "resync", uuid, "--extent", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = nvpool(&["volume", "resync", uuid, "--extent", "3"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("last copy in sync"), "{err}");
    wait_for(
        "extent 2 to be back in sync",
        Duration::from_secs(30),
        || {
            let v: Value = client.get(&format!("/v1/volumes/{uuid}")).unwrap();
            v["failed_extents"] == json!([]) && v["copy_jobs"] == json!([])
        },
    );

    stop.store(true, Ordering::Relaxed);
    healer.join().unwrap();
    drop(watching);
}
