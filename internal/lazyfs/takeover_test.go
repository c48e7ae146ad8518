package lazyfs

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// stuckSource hangs forever on one chunk, like a fetch that was in flight
// when the daemon died.
type stuckSource struct {
	*blobSource
	stuck chunkKey
	onHit func()
}

func (s *stuckSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	if keyOf(c) == s.stuck {
		s.onHit()
		select {}
	}
	return s.blobSource.ReadChunk(ctx, c)
}

// TestTakeoverChild is the first daemon of TestTakeover, run as a separate
// process so that it can die the way a daemon does.
func TestTakeoverChild(t *testing.T) {
	if os.Getenv("LAZYFS_TAKEOVER_CHILD") == "" {
		prereq.Skip(t, prereq.HelperProcess, "of TestTakeover")
	}
	blob, err := os.ReadFile(os.Getenv("LAZYFS_BLOB"))
	if err != nil {
		t.Fatal(err)
	}
	toc, err := layerfmt.ReadTOC(context.Background(), bytes.NewReader(blob), int64(len(blob)), "")
	if err != nil {
		t.Fatal(err)
	}
	frame, _ := strconv.ParseInt(os.Getenv("LAZYFS_STUCK_FRAME"), 10, 64)
	off, _ := strconv.ParseInt(os.Getenv("LAZYFS_STUCK_OFF"), 10, 64)
	src := &stuckSource{blobSource: newBlobSource(bytes.NewReader(blob)), stuck: chunkKey{frame, off}, onHit: func() { fmt.Println("STUCK") }}
	opts := []Option{WithDevFD(3)}
	if copies := os.Getenv("LAZYFS_COPIES"); copies != "" {
		b := newFileBacking()
		for _, c := range strings.Split(copies, ",") {
			idx, path, _ := strings.Cut(c, "=")
			i, _ := strconv.Atoi(idx)
			b.set(i, path)
		}
		opts = append(opts, WithBacking(b, os.Getenv("LAZYFS_STATE")))
	}
	srv, err := Mount(context.Background(), os.Getenv("LAZYFS_MNT"), toc, src, opts...)
	if err != nil {
		t.Fatal(err)
	}
	h, err := srv.Handover()
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(h.FD) // the test process already holds the connection
	fmt.Printf("INIT %x\n", h.Init)
	select {} // serve until killed
}

// TestTakeover kills a serving daemon in the middle of a read and lets a
// new server take over the live connection: open files, cached dentries,
// an open directory stream and the interrupted read keep working, without
// an unmount.
func TestTakeover(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	idx, _ := f.toc.Lookup("data/big")
	chunks := f.toc.Chunks(idx)
	stuck := chunks[5]
	rig := startTakeoverRig(t, f, fmt.Sprintf("LAZYFS_STUCK_FRAME=%d", stuck.Offset), fmt.Sprintf("LAZYFS_STUCK_OFF=%d", stuck.FrameOffset))
	mnt, open := rig.mnt, rig.open

	// State the kernel builds with the first server.
	passwd := open("etc/passwd")
	big := open("data/big")
	if err := unix.Fadvise(int(big.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	want := bigData()
	buf := make([]byte, 100)
	if _, err := big.ReadAt(buf, chunks[1].FileOffset); err != nil || !bytes.Equal(buf, want[chunks[1].FileOffset:][:100]) {
		t.Fatalf("read before takeover: %v", err)
	}
	dir := open("bin")
	firstNames, err := dir.Readdirnames(-1)
	if err != nil || len(firstNames) != 6 {
		t.Fatalf("readdir before takeover: %v %v", firstNames, err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "usr")); err != nil {
		t.Fatal(err)
	}

	// A read the first server will never answer.
	type result struct {
		b   []byte
		err error
	}
	stuckRead := make(chan result, 1)
	go func() {
		b := make([]byte, 100)
		_, err := big.ReadAt(b, stuck.FileOffset+10)
		stuckRead <- result{b, err}
	}()
	rig.waitLine("STUCK")

	// The first daemon dies; the test process still holds the connection.
	srv := rig.takeOver()

	select {
	case r := <-stuckRead:
		if r.err != nil || !bytes.Equal(r.b, want[stuck.FileOffset+10:][:100]) {
			t.Errorf("interrupted read after takeover: %v", r.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the read in flight when the first server died was not resent")
	}
	// A file opened from the first server, new chunk.
	if _, err := big.ReadAt(buf, chunks[9].FileOffset); err != nil || !bytes.Equal(buf, want[chunks[9].FileOffset:][:100]) {
		t.Errorf("read of a file opened before takeover: %v", err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "usr/kept")); err != nil || string(got) != "kept" {
		t.Errorf("lookup under a directory found by the first server: %q %v", got, err)
	}
	if _, err := dir.Seek(0, 0); err != nil {
		t.Fatal(err)
	}
	if names, err := dir.Readdirnames(-1); err != nil || len(names) != len(firstNames) {
		t.Errorf("directory stream opened before takeover: %v %v", names, err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "redo/fresh")); err != nil || string(got) != "fresh" {
		t.Errorf("new lookup: %q %v", got, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(mnt, "bin/ls"), &st); err != nil || st.Nlink != 3 {
		t.Errorf("stat after takeover: nlink %d %v", st.Nlink, err)
	}
	if got := make([]byte, 4); true {
		if _, err := passwd.ReadAt(got, 0); err != nil || string(got) != "root" {
			t.Errorf("file opened before takeover: %q %v", got, err)
		}
	}
	if srv.Stats().Ops["read"].Count == 0 {
		t.Error("the new server served no reads")
	}
}

// TestTakeoverUnknownIDs drives the takeover adapter directly, as the
// kernel would after a restart: node IDs and a directory handle issued by
// a previous server, which this bridge has never seen.
func TestTakeoverUnknownIDs(t *testing.T) {
	f := newFixture(t)
	newFS := func() *takeoverFS {
		root, err := NewRoot(f.toc, newBlobSource(bytes.NewReader(f.blob)))
		if err != nil {
			t.Fatal(err)
		}
		return newTakeoverFS(fs.NewNodeFS(root, fsOptions(defaultOptions())))
	}
	bin, _ := f.toc.Lookup("bin")
	passwd, _ := f.toc.Lookup("etc/passwd")
	gone, _ := f.toc.Lookup(".wh.gone")

	tfs := newFS()
	var attr fuse.AttrOut
	if st := tfs.GetAttr(nil, &fuse.GetAttrIn{InHeader: fuse.InHeader{NodeId: ino(passwd)}}, &attr); !st.Ok() || attr.Size != 26 {
		t.Errorf("getattr of a previous server's node: %v size %d", st, attr.Size)
	}
	if st := tfs.GetAttr(nil, &fuse.GetAttrIn{InHeader: fuse.InHeader{NodeId: ino(gone)}}, &attr); !st.Ok() || attr.Mode != syscall.S_IFCHR {
		t.Errorf("getattr of a previous server's whiteout: %v mode %o", st, attr.Mode)
	}
	buf := make([]byte, 64)
	res, st := tfs.Read(nil, &fuse.ReadIn{InHeader: fuse.InHeader{NodeId: ino(passwd)}, Size: 64}, buf)
	if !st.Ok() {
		t.Fatalf("read: %v", st)
	}
	if b, _ := res.Bytes(buf); string(b) != "root:x:0:0::/root:/bin/sh\n" {
		t.Errorf("read = %q", b)
	}

	// Continue a listing of bin/ from offset 2 on a handle we never issued.
	list := fuse.NewDirEntryList(make([]byte, 4096), 2)
	in := &fuse.ReadIn{InHeader: fuse.InHeader{NodeId: ino(bin)}, Fh: 4242, Offset: 2, Size: 4096}
	if st := tfs.ReadDir(nil, in, list); !st.Ok() {
		t.Fatalf("readdir on a previous server's handle: %v", st)
	}
	var names []string
	// struct fuse_dirent: ino u64, off u64, namelen u32, type u32, name,
	// padded to 8 bytes.
	for b := list.Bytes(); len(b) >= 24; {
		namelen := int(binary.LittleEndian.Uint32(b[16:]))
		names = append(names, string(b[24:24+namelen]))
		b = b[min(len(b), (24+namelen+7)&^7):]
	}
	// bin/ lists busybox cat ls sg sh su.
	if want := []string{"ls", "sg", "sh", "su"}; !slices.Equal(names, want) {
		t.Errorf("resumed listing = %v, want %v", names, want)
	}
	tfs.ReleaseDir(&fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: ino(bin)}, Fh: 4242})
	tfs.Forget(ino(passwd), 5) // counts from the previous server: ignored, no panic

	var out fuse.EntryOut
	if st := tfs.Lookup(nil, &fuse.InHeader{NodeId: uint64(f.toc.Len()) + 10}, "x", &out); st.Ok() {
		t.Error("lookup under a node ID beyond the TOC succeeded")
	}
}

// takeoverRig is a FUSE mount served by a first server in a child process
// (TestTakeoverChild, configured by env), which the test kills and
// replaces with a server taking the live connection over.
type takeoverRig struct {
	t      *testing.T
	f      fixtureLayer
	mnt    string
	fd     int // the test's own descriptor of the connection
	init   []byte
	srv    *Server // the successor, once takeOver has run
	opened []*os.File
	cmd    *exec.Cmd
	exited chan struct{}
	lines  chan string
}

// startTakeoverRig mounts f as a privileged parent would, keeping the
// connection's descriptor, and starts the first server on it.
func startTakeoverRig(t *testing.T, f fixtureLayer, env ...string) *takeoverRig {
	t.Helper()
	blobPath := filepath.Join(t.TempDir(), "blob")
	if err := os.WriteFile(blobPath, f.blob, 0o600); err != nil {
		t.Fatal(err)
	}
	r := &takeoverRig{t: t, f: f, mnt: t.TempDir(), exited: make(chan struct{}), lines: make(chan string, 16)}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	r.fd = fd
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,max_read=%d", fd, maxRequest)
	if err := unix.Mount("envsnap-takeover", r.mnt, "fuse.envsnap", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	// One cleanup, in the only safe order: files open on a connection
	// nobody serves would hang in close, so either the new server is
	// there (close files, then unmount) or the connection is aborted
	// first (closing the last /dev/fuse descriptor does that).
	t.Cleanup(func() {
		if r.srv == nil {
			unix.Close(r.fd)
		} else if t.Failed() {
			// A request may be left unanswered (that is what failed).
			abortConnection(t, r.srv.dev)
		}
		for _, f := range r.opened {
			f.Close()
		}
		if r.srv != nil {
			cleanupMount(t, r.mnt, r.srv)
		} else {
			_ = forceUnmount(r.mnt)
		}
	})

	childFD, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	r.cmd = exec.Command(os.Args[0], "-test.run=^TestTakeoverChild$")
	r.cmd.Env = append(append(os.Environ(), "LAZYFS_TAKEOVER_CHILD=1", "LAZYFS_BLOB="+blobPath, "LAZYFS_MNT="+r.mnt), env...)
	// Closed through its *os.File only: a unix.Close of the number would
	// leave the File's finalizer to close it again later, by then maybe
	// another test's descriptor (TestGoRootRoundTrip read EBADF).
	childFile := os.NewFile(uintptr(childFD), "fuse")
	r.cmd.ExtraFiles = []*os.File{childFile}
	r.cmd.Stderr = os.Stderr
	out, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	childFile.Close()
	go func() { r.cmd.Wait(); close(r.exited) }()
	t.Cleanup(func() { _ = r.cmd.Process.Kill(); <-r.exited })
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			r.lines <- sc.Text()
		}
		close(r.lines)
	}()
	if r.init, err = hex.DecodeString(strings.TrimSpace(r.waitLine("INIT "))); err != nil {
		t.Fatal(err)
	}
	return r
}

// waitLine returns the rest of the first server's next output line that
// starts with prefix.
func (r *takeoverRig) waitLine(prefix string) string {
	r.t.Helper()
	timeout := time.After(60 * time.Second)
	for {
		select {
		case l, ok := <-r.lines:
			if !ok {
				r.t.Fatalf("first server exited before printing %q", prefix)
			}
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return rest
			}
		case <-timeout:
			r.t.Fatalf("first server did not print %q", prefix)
		}
	}
}

// open opens p on the mount, closed at cleanup.
func (r *takeoverRig) open(p string) *os.File {
	r.t.Helper()
	f, err := os.Open(filepath.Join(r.mnt, p))
	if err != nil {
		r.t.Fatalf("open %s: %v", p, err)
	}
	r.opened = append(r.opened, f)
	return f
}

// takeOver kills the first server (the test still holds the connection)
// and serves the mount from this process with opts.
func (r *takeoverRig) takeOver(opts ...Option) *Server {
	r.t.Helper()
	if err := r.cmd.Process.Kill(); err != nil {
		r.t.Fatal(err)
	}
	<-r.exited
	src := newBlobSource(bytes.NewReader(r.f.blob))
	srv, err := Mount(context.Background(), r.mnt, r.f.toc, src, append([]Option{WithTakeover(Handover{FD: r.fd, Init: r.init})}, opts...)...)
	if err != nil {
		r.t.Fatalf("take over: %v", err)
	}
	r.srv = srv
	return srv
}
