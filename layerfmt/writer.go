package layerfmt

import (
	"archive/tar"
	"bufio"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"path"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// Write defaults. DefaultChunkSize was chosen by measurement
// (BenchmarkConvertSize, docs/layer-format.md): converted GOROOT is 7.2%
// larger than one zstd stream at the same level with 256 KiB frames, 3.9%
// at 1 MiB, 2.7% at 2 MiB and 2.2% at 4 MiB; 2 MiB is the smallest size
// within the 3% budget. Smaller frames cut read amplification but lose
// compression context.
const (
	DefaultChunkSize        = 2 << 20
	DefaultCompressionLevel = 3 // zstd's own default level
	// MinChunkSize keeps the per-frame overhead negligible.
	MinChunkSize = 4 << 10
)

var (
	encodersMu sync.Mutex
	encoders   = map[zstd.EncoderLevel]*zstd.Encoder{}
)

// encoderFor returns the shared encoder for a level. EncodeAll is safe
// for concurrent use and its output does not depend on which internal
// encoder serves the call, so conversions share encoders instead of
// allocating their tables each time.
func encoderFor(level int) (*zstd.Encoder, error) {
	l := zstd.EncoderLevelFromZstd(level)
	encodersMu.Lock()
	defer encodersMu.Unlock()
	if e, ok := encoders[l]; ok {
		return e, nil
	}
	e, err := zstd.NewWriter(nil,
		zstd.WithEncoderLevel(l),
		zstd.WithEncoderCRC(false), // every frame is covered by a sha256
		zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)),
		// Single-segment frames always record their content size, which
		// readers check before decompressing anything.
		zstd.WithSingleSegment(true))
	if err != nil {
		return nil, fmt.Errorf("create zstd encoder: %w", err)
	}
	encoders[l] = e
	return e, nil
}

type writeOptions struct {
	chunkSize int
	level     int
}

// WriteOption configures Convert.
type WriteOption func(*writeOptions)

// WithChunkSize sets the uncompressed size of frames, and so the largest
// chunk (default DefaultChunkSize; clamped to [MinChunkSize,
// MaxChunkSize]).
func WithChunkSize(n int) WriteOption {
	return func(o *writeOptions) { o.chunkSize = min(max(n, MinChunkSize), MaxChunkSize) }
}

// WithCompressionLevel sets the zstd level (1-22, as the zstd command line;
// klauspost/compress maps it to its nearest encoder level).
func WithCompressionLevel(level int) WriteOption {
	return func(o *writeOptions) { o.level = level }
}

// WriteResult describes a converted layer.
type WriteResult struct {
	Digest    digest.Digest // of the blob
	Size      int64         // blob size
	DiffID    digest.Digest // sha256 of the uncompressed tar stream (rootfs.diff_ids)
	TOCDigest digest.Digest
	TOCSize   int64
	Entries   int // TOC entries, including the root and implicit directories
}

// Annotations returns the annotations to put on the OCI layer descriptor.
func (r *WriteResult) Annotations() map[string]string {
	return map[string]string{
		AnnotationTOCDigest: r.TOCDigest.String(),
		AnnotationTOCSize:   strconv.FormatInt(r.TOCSize, 10),
		AnnotationVersion:   strconv.Itoa(Version),
	}
}

// Convert reads a tar stream and writes it to dst as a layer blob in this
// format. The tar is re-serialised canonically (so the output's diffID is
// the sha256 of the re-serialised tar, reported in the result); the same
// input and options always give a byte-identical blob. Memory is bounded by
// one chunk plus the TOC records.
//
// Convert refuses inputs the format cannot represent faithfully: absolute
// names or names escaping the root with "..", duplicate names, entries
// under a non-directory, hard links to entries not earlier in the same
// stream, ids or device numbers beyond 32 bits, sparse files, and tar
// types other than regular files, directories, symlinks, hard links,
// devices and FIFOs (PAX global headers are kept in the tar but not in the
// TOC).
func Convert(ctx context.Context, dst io.Writer, tarStream io.Reader, opts ...WriteOption) (*WriteResult, error) {
	x, err := NewWriter(dst, opts...)
	if err != nil {
		return nil, err
	}
	defer x.Abort()
	tr := tar.NewReader(tarStream)
	for n := 0; ; n++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read tar entry %d: %w", n, err)
		}
		if err := x.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if x.left > 0 {
			if _, err := io.CopyN(x, tr, x.left); err != nil {
				return nil, fmt.Errorf("copy %q: %w", hdr.Name, err)
			}
		}
	}
	return x.Close()
}

// Writer encodes a layer from tar entries handed to it one by one, as
// Convert does from a tar stream, for a caller that has the entries and
// would otherwise serialise them only for Convert to parse them again.
// The same entries give the same blob as Convert of their tar. A Writer
// is not safe for concurrent use; after an error only Abort is useful.
type Writer struct {
	w    *convWriter
	bw   *bufio.Writer
	tw   *tar.Writer
	n    int
	name string
	left int64 // data bytes the current entry still expects
	enc  *zstd.Encoder
	done bool
}

// NewWriter starts a layer written to dst. Close finishes it; Abort
// releases it after a failure.
func NewWriter(dst io.Writer, opts ...WriteOption) (*Writer, error) {
	o := writeOptions{chunkSize: DefaultChunkSize, level: DefaultCompressionLevel}
	for _, opt := range opts {
		opt(&o)
	}
	enc, err := encoderFor(o.level)
	if err != nil {
		return nil, err
	}
	bw := bufio.NewWriterSize(dst, 256<<10)
	w := &convWriter{
		cur:      make([]byte, 0, o.chunkSize+tarBlock),
		out:      bw,
		blobHash: sha256.New(),
		diffHash: sha256.New(),
		enc:      enc,
		chunkCap: o.chunkSize,
		nodes:    map[string]*node{},
	}
	w.root = &node{typ: TypeDir, mode: 0o755, implicit: true}
	w.nodes["."] = w.root
	w.startPipeline(runtime.GOMAXPROCS(0))
	return &Writer{w: w, bw: bw, tw: tar.NewWriter(w), enc: enc}, nil
}

// WriteHeader adds an entry (refused as Convert refuses it); a regular
// file's hdr.Size bytes of data follow with Write before the next entry.
func (x *Writer) WriteHeader(hdr *tar.Header) error {
	if x.left > 0 {
		return fmt.Errorf("tar entry %d %q: %d bytes of %q missing", x.n, hdr.Name, x.left, x.name)
	}
	w := x.w
	canon, nd, err := w.addHeader(hdr)
	if err != nil {
		return fmt.Errorf("tar entry %d %q: %w", x.n, hdr.Name, err)
	}
	x.n++
	w.fileNode = nil
	if err := x.tw.WriteHeader(canon); err != nil {
		return fmt.Errorf("write tar header %q: %w", hdr.Name, err)
	}
	x.name, x.left = hdr.Name, 0
	if nd != nil && canon.Size > 0 {
		if err := w.startFile(nd, canon.Size); err != nil {
			return err
		}
		x.left = canon.Size
	}
	return nil
}

// Write adds data of the current regular file.
func (x *Writer) Write(p []byte) (int, error) {
	if int64(len(p)) > x.left {
		return 0, fmt.Errorf("write %q: %d bytes past its end", x.name, int64(len(p))-x.left)
	}
	n, err := x.tw.Write(p)
	x.left -= int64(n)
	if x.left == 0 {
		x.w.fileNode = nil
	}
	if err != nil {
		return n, fmt.Errorf("write %q: %w", x.name, err)
	}
	return n, nil
}

// Abort stops the compression pipeline of a Writer that will not be
// closed; it does nothing after Close.
func (x *Writer) Abort() {
	if !x.done {
		x.done = true
		_ = x.w.stopPipeline()
	}
}

// Close writes the rest of the layer: the last frame, the TOC and the
// footer.
func (x *Writer) Close() (*WriteResult, error) {
	if x.left > 0 {
		return nil, fmt.Errorf("%d bytes of %q missing", x.left, x.name)
	}
	w, enc := x.w, x.enc
	x.done = true
	defer w.stopPipeline()
	if err := x.tw.Close(); err != nil {
		return nil, fmt.Errorf("finish tar: %w", err)
	}
	if err := w.flushFrame(); err != nil {
		return nil, err
	}
	if err := w.stopPipeline(); err != nil {
		return nil, err
	}
	dataEnd := w.off
	rawTOC, entries, err := w.encodeTOC(dataEnd)
	if err != nil {
		return nil, err
	}
	if len(rawTOC) > MaxTOCRawSize {
		return nil, fmt.Errorf("TOC of %d entries is %d bytes, over the %d limit readers enforce", entries, len(rawTOC), MaxTOCRawSize)
	}
	toc := enc.EncodeAll(rawTOC, nil)
	if len(toc) > MaxTOCSize {
		return nil, fmt.Errorf("TOC of %d entries encodes to %d bytes, over the %d limit", entries, len(toc), MaxTOCSize)
	}
	tocSum := sha256.Sum256(toc)
	tocDigest := digest.NewDigestFromBytes(digest.SHA256, tocSum[:])
	var sh [skippableHeaderSize]byte
	binary.LittleEndian.PutUint32(sh[0:], skippableTOCMagic)
	binary.LittleEndian.PutUint32(sh[4:], uint32(len(toc)))
	if err := w.write(sh[:]); err != nil {
		return nil, err
	}
	tocOff := w.off
	if err := w.write(toc); err != nil {
		return nil, err
	}
	if err := w.write(footer{tocOffset: tocOff, tocSize: int64(len(toc)), tocDigest: tocDigest}.marshal()); err != nil {
		return nil, err
	}
	if err := x.bw.Flush(); err != nil {
		return nil, fmt.Errorf("write layer blob: %w", err)
	}
	return &WriteResult{
		Digest:    digest.NewDigest(digest.SHA256, w.blobHash),
		Size:      w.off,
		DiffID:    digest.NewDigest(digest.SHA256, w.diffHash),
		TOCDigest: tocDigest,
		TOCSize:   int64(len(toc)),
		Entries:   entries,
	}, nil
}

// node is the writer's in-memory TOC record of one entry.
type node struct {
	base               string
	typ                EntryType
	mode               uint32
	uid, gid           uint32
	size               int64
	mtime              time.Time
	link               string
	devmajor, devminor uint32
	xattrs             [][2]string // sorted by key
	chunks             []chunkRec
	children           []*node
	implicit           bool
}

type chunkRec struct {
	fileOff        int64
	frame          uint32 // index into convWriter.frames, set when it is written
	frameOff, size uint32
}

type frameRec struct {
	off         int64
	csize, size uint32
	sum         [32]byte
}

// convWriter receives the canonical tar stream from archive/tar and cuts it
// into zstd frames of about chunkCap uncompressed bytes. Cuts are placed so
// that no file's bytes straddle two frames unless the file is larger than a
// frame: small files are packed, with the tar headers between them, into
// shared frames (one compression context for many small files is what keeps
// the blob close to a single zstd stream in size); a file that does not fit
// in the current frame starts a new one; a file larger than a frame is cut
// into chunkCap-sized pieces, each starting a frame, and its last piece
// shares its frame with what follows.
type convWriter struct {
	out      *bufio.Writer
	off      int64
	blobHash hash.Hash
	diffHash hash.Hash
	enc      *zstd.Encoder
	chunkCap int
	cur      []byte // uncompressed bytes of the frame being built
	pending  []pendingChunk
	nframes  int
	frames   []frameRec // written by the pipeline's writer goroutine

	jobs     chan *frameJob
	order    chan *frameJob
	pipeDone chan struct{}
	stopped  bool
	bufs     sync.Pool
	outs     sync.Pool // compressed frames, once written
	errMu    sync.Mutex
	err      error

	// While file data is being written: the file, bytes left in the file
	// and in its current chunk.
	fileNode  *node
	fileLeft  int64
	pieceLeft int64

	root  *node
	nodes map[string]*node // writer side only: cleaned path -> node
}

// pendingChunk is a chunk whose frame has not been written yet.
type pendingChunk struct {
	nd *node
	k  int
}

func (w *convWriter) write(b []byte) error {
	if _, err := w.out.Write(b); err != nil {
		return fmt.Errorf("write layer blob: %w", err)
	}
	w.blobHash.Write(b)
	w.off += int64(len(b))
	return nil
}

// startFile places the data of a regular file of size bytes.
func (w *convWriter) startFile(nd *node, size int64) error {
	if int64(len(w.cur))+size > int64(w.chunkCap) {
		if err := w.flushFrame(); err != nil {
			return err
		}
	}
	w.fileNode, w.fileLeft = nd, size
	w.addChunk(0)
	return nil
}

// addChunk opens the file's next chunk at the current end of the frame.
func (w *convWriter) addChunk(fileOff int64) {
	size := min(w.fileLeft, int64(w.chunkCap-len(w.cur)))
	nd := w.fileNode
	nd.chunks = append(nd.chunks, chunkRec{fileOff: fileOff, size: uint32(size), frameOff: uint32(len(w.cur))})
	w.pending = append(w.pending, pendingChunk{nd, len(nd.chunks) - 1})
	w.pieceLeft = size
}

// Write is the sink of the tar writer.
func (w *convWriter) Write(p []byte) (int, error) {
	if err := w.pipeErr(); err != nil {
		return 0, err
	}
	w.diffHash.Write(p)
	n := len(p)
	if w.fileNode == nil {
		// Tar headers and padding: no chunk refers to them, so the frame
		// may be cut anywhere inside them.
		for len(p) > 0 {
			k := min(len(p), w.chunkCap-len(w.cur))
			w.cur = append(w.cur, p[:k]...)
			p = p[k:]
			if len(w.cur) >= w.chunkCap {
				if err := w.flushFrame(); err != nil {
					return 0, err
				}
			}
		}
		return n, nil
	}
	for len(p) > 0 {
		if int64(len(p)) > w.fileLeft {
			return 0, errors.New("tar writer wrote past the end of a file")
		}
		if w.pieceLeft == 0 {
			// The previous piece filled its frame.
			if err := w.flushFrame(); err != nil {
				return 0, err
			}
			c := w.fileNode.chunks[len(w.fileNode.chunks)-1]
			w.addChunk(c.fileOff + int64(c.size))
		}
		k := min(int64(len(p)), w.pieceLeft)
		w.cur = append(w.cur, p[:k]...)
		p = p[k:]
		w.pieceLeft -= k
		w.fileLeft -= k
	}
	return n, nil
}

// flushFrame hands the frame being built to the compression pipeline and
// completes the chunk records that point into it.
func (w *convWriter) flushFrame() error {
	if err := w.pipeErr(); err != nil {
		return err
	}
	if len(w.cur) == 0 {
		return nil
	}
	idx := w.nframes
	w.nframes++
	for _, pc := range w.pending {
		pc.nd.chunks[pc.k].frame = uint32(idx)
	}
	w.pending = w.pending[:0]
	job := &frameJob{data: w.cur, done: make(chan struct{})}
	w.jobs <- job
	w.order <- job
	w.cur = w.getBuf()
	return nil
}

// The compression pipeline: frames are compressed and hashed by one worker
// per CPU and written in order by one writer goroutine, so conversion uses
// every core while the output stays byte-identical to a sequential run.
// At most cap(order) frames are in flight, which bounds memory.
type frameJob struct {
	data, out []byte
	sum       [32]byte
	done      chan struct{}
}

func (w *convWriter) startPipeline(workers int) {
	jobs, order, done := make(chan *frameJob), make(chan *frameJob, 2*workers), make(chan struct{})
	w.jobs, w.order, w.pipeDone = jobs, order, done
	for range workers {
		go func() {
			for job := range jobs {
				// Room for the worst case up front: EncodeAll appends
				// block by block, and an incompressible frame grown from
				// a smaller buffer cost more in copies than in
				// compression.
				job.out = w.enc.EncodeAll(job.data, w.getOut(len(job.data)))
				job.sum = sha256.Sum256(job.out)
				close(job.done)
			}
		}()
	}
	go func() {
		defer close(done)
		for job := range order {
			<-job.done
			if w.pipeErr() == nil {
				off := w.off
				if err := w.write(job.out); err != nil {
					w.setPipeErr(err)
				}
				w.frames = append(w.frames, frameRec{off: off, csize: uint32(len(job.out)), size: uint32(len(job.data)), sum: job.sum})
			}
			w.putBuf(job.data)
			w.outs.Put(&job.out)
		}
	}()
}

// stopPipeline waits for every submitted frame to be written. It is safe
// to call more than once.
func (w *convWriter) stopPipeline() error {
	if !w.stopped {
		w.stopped = true
		close(w.jobs)
		close(w.order)
		<-w.pipeDone
	}
	return w.pipeErr()
}

func (w *convWriter) pipeErr() error {
	w.errMu.Lock()
	defer w.errMu.Unlock()
	return w.err
}

func (w *convWriter) setPipeErr(err error) {
	w.errMu.Lock()
	defer w.errMu.Unlock()
	if w.err == nil {
		w.err = err
	}
}

func (w *convWriter) getBuf() []byte {
	if b, ok := w.bufs.Get().(*[]byte); ok {
		return (*b)[:0]
	}
	return make([]byte, 0, w.chunkCap+tarBlock)
}

// getOut returns an empty buffer that holds the compressed form of n
// bytes without growing.
func (w *convWriter) getOut(n int) []byte {
	need := w.enc.MaxEncodedSize(n)
	if b, ok := w.outs.Get().(*[]byte); ok && cap(*b) >= need {
		return (*b)[:0]
	}
	return make([]byte, 0, w.enc.MaxEncodedSize(max(n, w.chunkCap+tarBlock)))
}

func (w *convWriter) putBuf(b []byte) {
	if cap(b) >= w.chunkCap {
		w.bufs.Put(&b)
	}
}

// cleanName turns a tar name into a TOC path, refusing names that escape
// the root.
func cleanName(name string) (string, error) {
	if name == "" {
		return "", errors.New("empty name")
	}
	if strings.HasPrefix(name, "/") {
		return "", errors.New("absolute name")
	}
	p := path.Clean(name)
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", errors.New("name escapes the layer root")
	}
	if p != "." {
		for _, c := range strings.Split(p, "/") {
			if !validBase([]byte(c)) {
				return "", fmt.Errorf("bad path component %q", c)
			}
		}
	}
	return p, nil
}

const tarBlock = 512

const xattrPrefix = "SCHILY.xattr."

// addHeader validates a tar header, records its TOC node and returns the
// canonical header to write. The node is returned for regular files.
func (w *convWriter) addHeader(h *tar.Header) (*tar.Header, *node, error) {
	canon := &tar.Header{
		Typeflag:   h.Typeflag,
		Name:       h.Name,
		Mode:       h.Mode & unixModeMask,
		Uid:        h.Uid,
		Gid:        h.Gid,
		Uname:      h.Uname,
		Gname:      h.Gname,
		ModTime:    h.ModTime,
		AccessTime: h.AccessTime,
		ChangeTime: h.ChangeTime,
	}
	for k, v := range h.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			// Sparse files expand holes into data: a few header bytes
			// could make Convert write gigabytes. OCI tooling never
			// writes them.
			return nil, nil, errors.New("sparse files are not supported")
		}
		if canon.PAXRecords == nil {
			canon.PAXRecords = map[string]string{}
		}
		canon.PAXRecords[k] = v
	}
	if h.ModTime.Nanosecond() != 0 || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() {
		canon.Format = tar.FormatPAX // the other formats would round times
	}
	var typ EntryType
	switch h.Typeflag {
	case tar.TypeReg, tar.TypeRegA:
		typ, canon.Typeflag, canon.Size = TypeReg, tar.TypeReg, h.Size
	case tar.TypeDir:
		typ = TypeDir
	case tar.TypeSymlink:
		typ, canon.Linkname = TypeSymlink, h.Linkname
	case tar.TypeLink:
		typ, canon.Linkname = TypeHardlink, h.Linkname
	case tar.TypeChar, tar.TypeBlock:
		typ = TypeChar
		if h.Typeflag == tar.TypeBlock {
			typ = TypeBlock
		}
		if h.Devmajor < 0 || h.Devmajor > math.MaxUint32 || h.Devminor < 0 || h.Devminor > math.MaxUint32 {
			return nil, nil, fmt.Errorf("device %d:%d out of range", h.Devmajor, h.Devminor)
		}
		canon.Devmajor, canon.Devminor = h.Devmajor, h.Devminor
	case tar.TypeFifo:
		typ = TypeFIFO
	case tar.TypeXGlobalHeader:
		// Kept for fidelity (git archive writes one); not a file.
		return &tar.Header{Typeflag: tar.TypeXGlobalHeader, Name: h.Name, PAXRecords: canon.PAXRecords, Format: tar.FormatPAX}, nil, nil
	default:
		return nil, nil, fmt.Errorf("unsupported tar type %q", h.Typeflag)
	}
	if h.Uid < 0 || h.Uid > math.MaxUint32 || h.Gid < 0 || h.Gid > math.MaxUint32 {
		return nil, nil, fmt.Errorf("uid/gid %d/%d out of range", h.Uid, h.Gid)
	}
	if canon.Size < 0 {
		return nil, nil, fmt.Errorf("negative size")
	}
	name, err := cleanName(h.Name)
	if err != nil {
		return nil, nil, err
	}
	nd := &node{
		typ:      typ,
		mode:     uint32(canon.Mode),
		uid:      uint32(h.Uid),
		gid:      uint32(h.Gid),
		size:     canon.Size,
		mtime:    h.ModTime,
		devmajor: uint32(canon.Devmajor),
		devminor: uint32(canon.Devminor),
	}
	if nsec := h.ModTime.UnixNano(); h.ModTime.Unix() < math.MinInt64/2 || nsec == math.MinInt64 {
		return nil, nil, errors.New("modification time out of range")
	}
	switch typ {
	case TypeSymlink:
		if h.Linkname == "" || len(h.Linkname) > MaxNameLen || strings.IndexByte(h.Linkname, 0) >= 0 {
			return nil, nil, fmt.Errorf("bad symlink target %q", h.Linkname)
		}
		nd.link = h.Linkname
	case TypeHardlink:
		target, err := cleanName(h.Linkname)
		if err != nil || target == "." {
			return nil, nil, fmt.Errorf("bad hard-link target %q", h.Linkname)
		}
		t, ok := w.nodes[target]
		if !ok || t.typ == TypeDir {
			return nil, nil, fmt.Errorf("hard-link target %q is not an earlier non-directory entry", target)
		}
		nd.link = target
	}
	for k, v := range canon.PAXRecords {
		if key, ok := strings.CutPrefix(k, xattrPrefix); ok {
			if key == "" || len(key) > maxXattrKeyLen || len(v) > maxXattrValLen {
				return nil, nil, fmt.Errorf("bad xattr %q", key)
			}
			nd.xattrs = append(nd.xattrs, [2]string{key, v})
		}
	}
	slices.SortFunc(nd.xattrs, func(a, b [2]string) int { return cmp.Compare(a[0], b[0]) })

	if name == "." {
		if typ != TypeDir || !w.root.implicit {
			return nil, nil, errors.New("root entry is not a directory or repeated")
		}
		nd.children = w.root.children
		*w.root = *nd
		return canon, nil, nil
	}
	if old, ok := w.nodes[name]; ok {
		// A directory implied by an earlier path may be given its real
		// metadata once; anything else is a duplicate.
		if !old.implicit || typ != TypeDir {
			return nil, nil, errors.New("duplicate name")
		}
		nd.base, nd.children = old.base, old.children
		*old = *nd
		return canon, nil, nil
	}
	dir, base := path.Split(name)
	parent, err := w.dir(strings.TrimSuffix(dir, "/"))
	if err != nil {
		return nil, nil, err
	}
	if len(w.nodes) >= MaxEntries {
		return nil, nil, fmt.Errorf("more than %d entries", MaxEntries)
	}
	nd.base = base
	parent.children = append(parent.children, nd)
	w.nodes[name] = nd
	if typ == TypeReg {
		return canon, nd, nil
	}
	return canon, nil, nil
}

// dir returns the directory node for p, creating implicit ones.
func (w *convWriter) dir(p string) (*node, error) {
	if p == "" {
		p = "."
	}
	if nd, ok := w.nodes[p]; ok {
		if nd.typ != TypeDir {
			return nil, fmt.Errorf("parent %q is not a directory", p)
		}
		return nd, nil
	}
	d, base := path.Split(p)
	parent, err := w.dir(strings.TrimSuffix(d, "/"))
	if err != nil {
		return nil, err
	}
	nd := &node{base: base, typ: TypeDir, mode: 0o755, implicit: true}
	parent.children = append(parent.children, nd)
	w.nodes[p] = nd
	return nd, nil
}

// encodeTOC lays the nodes out breadth-first and encodes the raw TOC.
func (w *convWriter) encodeTOC(dataEnd int64) ([]byte, int, error) {
	order := []*node{w.root}
	parents := []uint32{0}
	for i := 0; i < len(order); i++ {
		nd := order[i]
		slices.SortFunc(nd.children, func(a, b *node) int { return strings.Compare(a.base, b.base) })
		for _, c := range nd.children {
			order = append(order, c)
			parents = append(parents, uint32(i))
		}
	}
	n := len(order)
	var nChunks, nXattrs int
	for _, nd := range order {
		nChunks += len(nd.chunks)
		nXattrs += len(nd.xattrs)
	}
	var strs []byte
	addStr := func(s string) (uint32, uint32, error) {
		if uint64(len(strs))+uint64(len(s)) > math.MaxUint32 {
			return 0, 0, errors.New("TOC string table exceeds 4 GiB")
		}
		off := uint32(len(strs))
		strs = append(strs, s...)
		return off, uint32(len(s)), nil
	}
	nFrames := len(w.frames)
	if n > MaxEntries {
		return nil, 0, fmt.Errorf("%d entries exceed the limit of %d", n, MaxEntries)
	}
	raw := make([]byte, tocHeaderSize+n*entryRecSize+nChunks*chunkRecSize+nFrames*frameRecSize+nXattrs*xattrRecSize)
	le := binary.LittleEndian
	copy(raw, tocMagic)
	le.PutUint32(raw[8:], Version)
	le.PutUint32(raw[16:], uint32(n))
	le.PutUint32(raw[20:], uint32(nChunks))
	le.PutUint32(raw[24:], uint32(nFrames))
	le.PutUint32(raw[28:], uint32(nXattrs))
	le.PutUint32(raw[36:], entryRecSize)
	le.PutUint32(raw[40:], chunkRecSize)
	le.PutUint32(raw[44:], frameRecSize)
	le.PutUint32(raw[48:], xattrRecSize)
	le.PutUint64(raw[56:], uint64(dataEnd))
	entries := raw[tocHeaderSize:]
	chunks := entries[n*entryRecSize:]
	frames := chunks[nChunks*chunkRecSize:]
	xattrs := frames[nFrames*frameRecSize:]
	for k, f := range w.frames {
		fr := frames[k*frameRecSize:]
		le.PutUint64(fr[fOffset:], uint64(f.off))
		le.PutUint32(fr[fCSize:], f.csize)
		le.PutUint32(fr[fSize:], f.size)
		copy(fr[fDigest:fDigest+32], f.sum[:])
	}
	next := 1 // index of the first child of the next directory in BFS order
	var ci, xi int
	for i, nd := range order {
		r := entries[i*entryRecSize:]
		le.PutUint32(r[eParent:], parents[i])
		if i != 0 {
			off, l, err := addStr(nd.base)
			if err != nil {
				return nil, 0, err
			}
			le.PutUint32(r[eNameOff:], off)
			le.PutUint32(r[eNameLen:], l)
		}
		r[eType] = byte(nd.typ)
		if nd.implicit {
			r[eFlags] = flagImplicit
		}
		le.PutUint32(r[eMode:], nd.mode)
		le.PutUint32(r[eUID:], nd.uid)
		le.PutUint32(r[eGID:], nd.gid)
		if !nd.mtime.IsZero() {
			le.PutUint64(r[eMtime:], uint64(nd.mtime.Unix()))
			le.PutUint32(r[eNsec:], uint32(nd.mtime.Nanosecond()))
		}
		le.PutUint64(r[eSize:], uint64(nd.size))
		switch nd.typ {
		case TypeDir:
			if len(nd.children) > 0 {
				le.PutUint32(r[eA:], uint32(next))
				le.PutUint32(r[eB:], uint32(len(nd.children)))
				next += len(nd.children)
			}
		case TypeReg:
			if len(nd.chunks) > 0 {
				le.PutUint32(r[eA:], uint32(ci))
				le.PutUint32(r[eB:], uint32(len(nd.chunks)))
				for _, c := range nd.chunks {
					cr := chunks[ci*chunkRecSize:]
					le.PutUint64(cr[cFileOff:], uint64(c.fileOff))
					le.PutUint32(cr[cFrame:], c.frame)
					le.PutUint32(cr[cFrameOff:], c.frameOff)
					le.PutUint32(cr[cSize:], c.size)
					ci++
				}
			}
		case TypeChar, TypeBlock:
			le.PutUint32(r[eA:], nd.devmajor)
			le.PutUint32(r[eB:], nd.devminor)
		}
		if nd.link != "" {
			off, l, err := addStr(nd.link)
			if err != nil {
				return nil, 0, err
			}
			le.PutUint32(r[eLinkOff:], off)
			le.PutUint32(r[eLinkLen:], l)
		}
		if len(nd.xattrs) > 0 {
			le.PutUint32(r[eXattrOff:], uint32(xi))
			le.PutUint32(r[eXattrN:], uint32(len(nd.xattrs)))
			for _, kv := range nd.xattrs {
				xr := xattrs[xi*xattrRecSize:]
				ko, kl, err := addStr(kv[0])
				if err != nil {
					return nil, 0, err
				}
				vo, vl, err := addStr(kv[1])
				if err != nil {
					return nil, 0, err
				}
				le.PutUint32(xr[0:], ko)
				le.PutUint32(xr[4:], kl)
				le.PutUint32(xr[8:], vo)
				le.PutUint32(xr[12:], vl)
				xi++
			}
		}
	}
	le.PutUint32(raw[32:], uint32(len(strs)))
	return append(raw, strs...), n, nil
}
