package envsnapshot

import (
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"

	"github.com/containerd/continuity/fs"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// measure sums the file data below an upper directory, so an oversized
// diff is refused before the container is frozen.
func measure(dir string, maxData int64) (int64, error) {
	var total int64
	err := filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		total += fi.Size()
		if maxData > 0 && total > maxData {
			return fmt.Errorf("%w: over %d bytes of file data: %w", ErrDiffTooLarge, maxData, errdefs.ErrResourceExhausted)
		}
		return nil
	})
	if err != nil {
		return total, fmt.Errorf("measure %s: %w", dir, err)
	}
	return total, nil
}

// stage copies an upper directory to dst, keeping everything WriteUpperTar
// reads: owners, modes, times, xattrs (overlay's opaque marker included),
// whiteout devices, hard links and holes. It runs while the container is
// frozen, so it must be quick: dst should be on tmpfs (continuity's copier
// fsyncs every file it writes, which costs nothing there).
func stage(upper, dst string) error {
	if err := fs.CopyDir(dst, upper); err != nil {
		return fmt.Errorf("copy upper %s: %w", upper, err)
	}
	// CopyDir dates each directory before filling it, which moves its
	// mtime again: date them once more, now that they are complete.
	err := filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		return unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(dst, rel), []unix.Timespec{st.Atim, st.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil {
		return fmt.Errorf("copy upper %s: directory times: %w", upper, err)
	}
	return nil
}

// stagingRoot picks where staged copies go: dir if set, else /dev/shm when
// it is a tmpfs with room for twice the diff, else the system temporary
// directory.
func stagingRoot(dir string, need int64) string {
	if dir != "" {
		return dir
	}
	var st unix.Statfs_t
	if unix.Statfs("/dev/shm", &st) == nil && st.Type == unix.TMPFS_MAGIC && int64(st.Bavail)*st.Bsize > 2*need {
		return "/dev/shm"
	}
	return os.TempDir()
}
