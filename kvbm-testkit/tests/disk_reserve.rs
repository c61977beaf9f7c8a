//! G3 space is reserved up front on a real file system without
//! `fallocate` (a small ext2 on a loop device): a file that fits is zeroed
//! in full, one that does not is refused at allocation with an error that
//! names the file, the size and the file system, and leaves no file. The
//! test skips where a loop device cannot be mounted (not root, no loop
//! devices).

use std::os::unix::fs::MetadataExt;

use kvbm_testkit::small_fs::SmallFs;
use kvbm_transfer::TransferError;
use kvbm_transfer::memory::{DiskAllocator, DiskOptions};

#[test]
fn ext2_without_fallocate_is_zero_filled_or_refused() {
    let fs = match SmallFs::ext2(16 << 20) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let dir = fs.path().join("g3");
    let alloc = DiskAllocator::new(&dir, DiskOptions::default()).unwrap();

    // Fits: every byte is allocated (no sparse file).
    let f = alloc.allocate(4 << 20).unwrap();
    let on_disk = std::fs::metadata(f.path()).unwrap().blocks() * 512;
    assert!(
        on_disk >= 4 << 20,
        "sparse G3 file: {on_disk} bytes on disk"
    );
    drop(f);

    // Does not fit: refused now, naming file, size and file system.
    let err = alloc.allocate(64 << 20).unwrap_err();
    let TransferError::Reserve {
        path,
        len,
        fs: kind,
        ..
    } = &err
    else {
        panic!("not a reservation error: {err}");
    };
    assert_eq!(*len, 64 << 20);
    assert_eq!(kind.and_then(|k| k.name()), Some("ext2/ext3/ext4"));
    assert_eq!(err.os_error(), Some(libc::ENOSPC));
    let msg = err.to_string();
    for want in [
        path.to_str().unwrap(),
        "67108864 bytes",
        "ext2/ext3/ext4",
        "writing zeros",
    ] {
        assert!(msg.contains(want), "`{want}` missing from: {msg}");
    }
    assert!(!path.exists(), "the refused file was left behind");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}
