package layerfmt

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// tailReadSize is how much ReadTOC reads from the end of the blob in its
// first request: the footer plus, for layers up to a few thousand files,
// the whole TOC, so that most layers need a single range read.
const tailReadSize = 64 << 10

// readFull reads exactly len(p) bytes at off, mapping a short read to
// ErrTruncated.
func readFull(ra io.ReaderAt, p []byte, off int64) error {
	n, err := ra.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("read %d bytes at %d: got %d: %w", len(p), off, n, ErrTruncated)
	}
	return fmt.Errorf("read %d bytes at %d: %w", len(p), off, err)
}

// TailSize is how many bytes at the end of a blob hold the footer and the
// TOC frame, given the encoded TOC size (AnnotationTOCSize). A reader that
// has the descriptor fetches exactly this range and calls DecodeTail: one
// request for all metadata.
func TailSize(tocSize int64) int64 { return tocSize + skippableHeaderSize + FooterSize }

// ReadTOC reads and decodes the TOC of a blob of blobSize bytes with at
// most two ReadAt calls: the tail (footer and, usually, the TOC) and, when
// the TOC is larger than the tail read, the TOC itself. When expect is not
// empty (the AnnotationTOCDigest value) the TOC is verified against it;
// otherwise against the digest recorded in the footer, which detects
// corruption but is not a trust root.
func ReadTOC(ctx context.Context, ra io.ReaderAt, blobSize int64, expect digest.Digest) (*TOC, error) {
	if blobSize < FooterSize+skippableHeaderSize {
		return nil, fmt.Errorf("blob of %d bytes: %w", blobSize, ErrNotLayer)
	}
	tailOff := max(0, blobSize-tailReadSize)
	tail := make([]byte, blobSize-tailOff)
	if err := readFull(ra, tail, tailOff); err != nil {
		return nil, fmt.Errorf("read layer tail: %w", err)
	}
	f, err := parseFooter(tail[len(tail)-FooterSize:], blobSize)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if need := TailSize(f.tocSize); need > int64(len(tail)) {
		tail = make([]byte, need)
		if err := readFull(ra, tail, blobSize-need); err != nil {
			return nil, fmt.Errorf("read layer TOC: %w", err)
		}
	}
	return DecodeTail(tail, blobSize, expect)
}

// DecodeTail decodes the footer and TOC from the last bytes of a blob of
// blobSize bytes (tail must hold at least TailSize of the TOC; more is
// fine). expect is as for ReadTOC.
func DecodeTail(tail []byte, blobSize int64, expect digest.Digest) (*TOC, error) {
	if int64(len(tail)) > blobSize || len(tail) < FooterSize {
		return nil, fmt.Errorf("tail of %d bytes for a blob of %d: %w", len(tail), blobSize, ErrTruncated)
	}
	f, err := parseFooter(tail[len(tail)-FooterSize:], blobSize)
	if err != nil {
		return nil, err
	}
	need := TailSize(f.tocSize)
	if need > int64(len(tail)) {
		return nil, fmt.Errorf("tail of %d bytes does not hold the %d-byte TOC: %w", len(tail), f.tocSize, ErrTruncated)
	}
	frame := tail[int64(len(tail))-need : len(tail)-FooterSize]
	frameOff := f.tocOffset - skippableHeaderSize
	if binary.LittleEndian.Uint32(frame[0:]) != skippableTOCMagic || int64(binary.LittleEndian.Uint32(frame[4:])) != f.tocSize {
		return nil, fmt.Errorf("TOC skippable frame header: %w", ErrBadTOC)
	}
	want := expect
	if want == "" {
		want = f.tocDigest
	} else if f.tocDigest != expect {
		return nil, fmt.Errorf("footer records TOC %s, descriptor %s: %w", f.tocDigest, expect, ErrDigestMismatch)
	}
	t, err := DecodeTOC(frame[skippableHeaderSize:], want)
	if err != nil {
		return nil, err
	}
	if t.DataEnd() != frameOff {
		return nil, fmt.Errorf("TOC says data ends at %d, TOC frame starts at %d: %w", t.DataEnd(), frameOff, ErrBadTOC)
	}
	return t, nil
}

var (
	chunkDecoderOnce sync.Once
	chunkDecoder     *zstd.Decoder
)

func getChunkDecoder() *zstd.Decoder {
	chunkDecoderOnce.Do(func() {
		var err error
		chunkDecoder, err = zstd.NewReader(nil,
			zstd.WithDecoderConcurrency(0),
			zstd.WithDecodeAllCapLimit(true),
			zstd.WithDecoderMaxMemory(MaxChunkSize),
			zstd.WithDecoderMaxWindow(MaxChunkSize))
		if err != nil {
			panic(err)
		}
	})
	return chunkDecoder
}

// DecodeChunk verifies compressed (the frame bytes
// blob[c.Offset:][:c.CompressedSize]) against c.Digest before decompressing
// anything, decompresses the frame into dst (reused when its capacity is at
// least c.FrameSize), refusing output larger than c.FrameSize, and returns
// the chunk's c.Size bytes.
func DecodeChunk(c Chunk, compressed []byte, dst []byte) ([]byte, error) {
	frame, err := DecodeFrame(c, compressed, dst)
	if err != nil {
		return nil, err
	}
	return frame[c.FrameOffset : c.FrameOffset+c.Size], nil
}

// DecodeFrame is DecodeChunk returning the whole decompressed frame
// (c.FrameSize bytes), for callers that cache frames shared by chunks.
func DecodeFrame(c Chunk, compressed []byte, dst []byte) ([]byte, error) {
	if err := checkFrame(c, compressed); err != nil {
		return nil, err
	}
	if err := verifySHA256(compressed, c.Digest); err != nil {
		return nil, fmt.Errorf("chunk at %d: %w", c.Offset, err)
	}
	return decodeFrame(c, compressed, dst)
}

// DecodeVerifiedFrame is DecodeFrame for compressed bytes the caller has
// already checked against c.Digest (a verified cache read, a fetched frame
// hashed on arrival): hashing is most of a cached read's CPU, and doing it
// twice per frame halved the read throughput. Every other check (sizes,
// frame header, decompressed size) still applies.
func DecodeVerifiedFrame(c Chunk, compressed []byte, dst []byte) ([]byte, error) {
	if err := checkFrame(c, compressed); err != nil {
		return nil, err
	}
	return decodeFrame(c, compressed, dst)
}

func checkFrame(c Chunk, compressed []byte) error {
	if c.Size <= 0 || c.FrameSize > MaxChunkSize || c.FrameOffset < 0 || c.FrameOffset+c.Size > c.FrameSize ||
		c.CompressedSize <= 0 || c.CompressedSize > MaxCompressedChunkSize {
		return fmt.Errorf("chunk at %d: sizes %d/%d/%d+%d: %w", c.Offset, c.CompressedSize, c.FrameSize, c.FrameOffset, c.Size, ErrBadTOC)
	}
	if int64(len(compressed)) != c.CompressedSize {
		return fmt.Errorf("chunk at %d: have %d of %d bytes: %w", c.Offset, len(compressed), c.CompressedSize, ErrTruncated)
	}
	return nil
}

// frameSlack is the room decodeFrame wants past a frame's end: the zstd
// decoder copies matches with 16-byte wide stores, and with no room for
// them it takes its "safe" loop for the whole frame, which cost 1.13-1.17x
// the CPU time per 2 MiB frame of executable-like bytes here. The frame
// header already promised FrameSize bytes and the length is checked after
// decoding, so the slack never holds output.
const frameSlack = 16

// FrameBufferSize is the capacity a dst given to DecodeFrame or
// DecodeVerifiedFrame needs for c's frame to be decoded into it rather than
// into a new allocation.
func FrameBufferSize(c Chunk) int64 { return c.FrameSize + frameSlack }

func decodeFrame(c Chunk, compressed []byte, dst []byte) ([]byte, error) {
	var h zstd.Header
	if err := h.Decode(compressed); err != nil || h.Skippable || !h.HasFCS || h.DictionaryID != 0 || h.FrameContentSize != uint64(c.FrameSize) {
		return nil, fmt.Errorf("chunk at %d: frame header does not declare %d bytes: %w", c.Offset, c.FrameSize, ErrBadTOC)
	}
	if int64(cap(dst)) < FrameBufferSize(c) {
		dst = make([]byte, 0, FrameBufferSize(c))
	}
	out, err := getChunkDecoder().DecodeAll(compressed, dst[:0:FrameBufferSize(c)])
	if err != nil {
		return nil, fmt.Errorf("chunk at %d: decompress: %v: %w", c.Offset, err, ErrBadTOC)
	}
	if int64(len(out)) != c.FrameSize {
		return nil, fmt.Errorf("chunk at %d: decompressed %d bytes, want %d: %w", c.Offset, len(out), c.FrameSize, ErrBadTOC)
	}
	return out, nil
}

// Reader reads a whole layer blob through an io.ReaderAt. It implements
// io/fs.FS (and fs.StatFS, fs.ReadDirFS, fs.ReadLinkFS) over the layer's
// entries; every byte it returns has been verified against its chunk
// digest. Open follows symbolic links inside the layer (absolute targets
// are resolved against the layer root); whiteout entries are ordinary
// files. It is safe for concurrent use.
type Reader struct {
	ra   io.ReaderAt
	size int64
	toc  *TOC

	// A few recently decoded frames: small files share frames, so walking
	// a directory would otherwise decompress the same frame once per file.
	mu     sync.Mutex
	frames [frameCacheSize]cachedFrame
	clock  int
}

const frameCacheSize = 4

type cachedFrame struct {
	off  int64 // blob offset of the frame; the TOC verified it holds digest
	data []byte
	used int
}

// NewReader reads the TOC of a blob of size bytes (see ReadTOC).
func NewReader(ra io.ReaderAt, size int64, expectTOC digest.Digest) (*Reader, error) {
	t, err := ReadTOC(context.Background(), ra, size, expectTOC)
	if err != nil {
		return nil, err
	}
	return &Reader{ra: ra, size: size, toc: t}, nil
}

// TOC returns the layer's table of contents.
func (r *Reader) TOC() *TOC { return r.toc }

// ReadChunk fetches, verifies and decompresses chunk c, returning its
// c.Size bytes (dst may be reused for the frame).
func (r *Reader) ReadChunk(c Chunk, dst []byte) ([]byte, error) {
	frame, err := r.readFrame(c, dst)
	if err != nil {
		return nil, err
	}
	return frame[c.FrameOffset : c.FrameOffset+c.Size], nil
}

func (r *Reader) readFrame(c Chunk, dst []byte) ([]byte, error) {
	if c.Offset < 0 || c.CompressedSize <= 0 || c.CompressedSize > MaxCompressedChunkSize || c.Offset+c.CompressedSize > r.toc.DataEnd() {
		return nil, fmt.Errorf("chunk %d+%d outside the data: %w", c.Offset, c.CompressedSize, ErrBadTOC)
	}
	buf := make([]byte, c.CompressedSize)
	if err := readFull(r.ra, buf, c.Offset); err != nil {
		return nil, fmt.Errorf("read chunk: %w", err)
	}
	return DecodeFrame(c, buf, dst)
}

// cachedFrame returns the decoded frame of c, from the cache when it was
// decoded recently. Cached frames are never modified.
func (r *Reader) cachedFrame(j, k int) ([]byte, Chunk, error) {
	// The cache is keyed by frame offset: a verified frame at an offset is
	// the same bytes for every chunk that names that offset.
	c := r.toc.chunkGeometry(j, k)
	off, frameSize := c.Offset, c.FrameSize
	r.mu.Lock()
	r.clock++
	for k := range r.frames {
		f := &r.frames[k]
		if f.data != nil && f.off == off && int64(len(f.data)) == frameSize {
			f.used = r.clock
			r.mu.Unlock()
			return f.data, c, nil
		}
	}
	r.mu.Unlock()
	c = r.toc.Chunk(j, k)
	data, err := r.readFrame(c, nil)
	if err != nil {
		return nil, c, err
	}
	r.mu.Lock()
	victim := 0
	for k := range r.frames {
		if r.frames[k].used < r.frames[victim].used {
			victim = k
		}
	}
	r.frames[victim] = cachedFrame{off: c.Offset, data: data, used: r.clock}
	r.mu.Unlock()
	return data, c, nil
}

// ReadFileAt reads len(p) bytes of entry i's content at off, following
// hard links, touching only the chunks that hold the range. Like
// io.ReaderAt it returns io.EOF when fewer bytes remain.
func (r *Reader) ReadFileAt(i int, p []byte, off int64) (int, error) {
	t := r.toc
	if i < 0 || i >= t.Len() {
		return 0, fmt.Errorf("entry %d out of range: %w", i, fs.ErrNotExist)
	}
	j, ok := t.Resolve(i)
	if !ok {
		return 0, fmt.Errorf("%s: hard-link target not in layer: %w", t.Name(i), fs.ErrNotExist)
	}
	if t.Type(j) != TypeReg {
		return 0, fmt.Errorf("%s is a %s, not a regular file: %w", t.Name(i), t.Type(j), fs.ErrInvalid)
	}
	if off < 0 {
		return 0, fmt.Errorf("negative offset: %w", fs.ErrInvalid)
	}
	size := t.Size(j)
	if off >= size {
		return 0, io.EOF
	}
	n := 0
	for n < len(p) && off < size {
		frame, c, err := r.cachedFrame(j, t.ChunkAt(j, off))
		if err != nil {
			return n, fmt.Errorf("read %s: %w", t.Name(i), err)
		}
		data := frame[c.FrameOffset : c.FrameOffset+c.Size]
		m := copy(p[n:], data[off-c.FileOffset:])
		n += m
		off += int64(m)
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// maxSymlinkHops bounds symlink resolution, as Linux's MAXSYMLINKS does.
const maxSymlinkHops = 40

// resolve finds the entry for a slash-separated path, following symlinks
// in every component and, when followLast is set, in the last one.
func (r *Reader) resolve(name string, followLast bool) (int, error) {
	t := r.toc
	if name == "." {
		return 0, nil
	}
	rest := strings.Split(name, "/")
	cur, hops := 0, 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			cur = t.Parent(cur)
			continue
		}
		if t.Type(cur) != TypeDir {
			return -1, fs.ErrNotExist
		}
		next, ok := t.LookupChild(cur, c)
		if !ok {
			return -1, fs.ErrNotExist
		}
		if t.Type(next) == TypeSymlink && (len(rest) > 0 || followLast) {
			if hops++; hops > maxSymlinkHops {
				return -1, errors.New("too many levels of symbolic links")
			}
			target := t.linkname(next)
			if strings.HasPrefix(target, "/") {
				cur = 0
			}
			rest = append(strings.Split(target, "/"), rest...)
			continue
		}
		cur = next
	}
	return cur, nil
}

func (t *TOC) linkname(i int) string {
	r := t.rec(i)
	return string(t.str(le32(r, eLinkOff), le32(r, eLinkLen)))
}

func (r *Reader) lookup(op, name string, followLast bool) (int, error) {
	if !fs.ValidPath(name) {
		return -1, &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
	}
	i, err := r.resolve(name, followLast)
	if err != nil {
		return -1, &fs.PathError{Op: op, Path: name, Err: err}
	}
	return i, nil
}

// Open opens the named entry, following symbolic links.
func (r *Reader) Open(name string) (fs.File, error) {
	i, err := r.lookup("open", name, true)
	if err != nil {
		return nil, err
	}
	info := r.info(i, path.Base(name))
	if r.toc.Type(i) == TypeDir {
		return &dirFile{r: r, info: info}, nil
	}
	return &regFile{r: r, info: info}, nil
}

// Stat returns information about the named entry, following symlinks.
func (r *Reader) Stat(name string) (fs.FileInfo, error) {
	i, err := r.lookup("stat", name, true)
	if err != nil {
		return nil, err
	}
	return r.info(i, path.Base(name)), nil
}

// Lstat returns information about the named entry without following a
// final symlink.
func (r *Reader) Lstat(name string) (fs.FileInfo, error) {
	i, err := r.lookup("lstat", name, false)
	if err != nil {
		return nil, err
	}
	return r.info(i, path.Base(name)), nil
}

// ReadLink returns the target of the named symlink.
func (r *Reader) ReadLink(name string) (string, error) {
	i, err := r.lookup("readlink", name, false)
	if err != nil {
		return "", err
	}
	if r.toc.Type(i) != TypeSymlink {
		return "", &fs.PathError{Op: "readlink", Path: name, Err: fs.ErrInvalid}
	}
	return r.toc.linkname(i), nil
}

// ReadDir returns the entries of the named directory, sorted by name.
func (r *Reader) ReadDir(name string) ([]fs.DirEntry, error) {
	i, err := r.lookup("readdir", name, true)
	if err != nil {
		return nil, err
	}
	if r.toc.Type(i) != TypeDir {
		return nil, &fs.PathError{Op: "readdir", Path: name, Err: errors.New("not a directory")}
	}
	first, n := r.toc.ChildRange(i)
	out := make([]fs.DirEntry, n)
	for k := range out {
		out[k] = fs.FileInfoToDirEntry(r.info(first+k, r.toc.BaseName(first+k)))
	}
	return out, nil
}

// fileInfo describes an entry; hard links report their target's metadata
// (they are the same inode).
type fileInfo struct {
	name string
	toc  *TOC
	i    int // the entry itself
	data int // the entry holding metadata and data (hard links resolved)
}

func (r *Reader) info(i int, name string) *fileInfo {
	d, ok := r.toc.Resolve(i)
	if !ok {
		d = i
	}
	if name == "." && i != 0 {
		name = r.toc.BaseName(i)
	}
	return &fileInfo{name: name, toc: r.toc, i: i, data: d}
}

func (fi *fileInfo) Name() string       { return fi.name }
func (fi *fileInfo) Size() int64        { return fi.toc.Size(fi.data) }
func (fi *fileInfo) Mode() fs.FileMode  { return fi.toc.Mode(fi.data) }
func (fi *fileInfo) ModTime() time.Time { return fi.toc.Entry(fi.data).ModTime }
func (fi *fileInfo) IsDir() bool        { return fi.toc.Type(fi.data) == TypeDir }

// Sys returns the layerfmt Entry of the (resolved) entry.
func (fi *fileInfo) Sys() any { return fi.toc.Entry(fi.data) }

type regFile struct {
	r      *Reader
	info   *fileInfo
	off    int64
	closed bool
}

func (f *regFile) Stat() (fs.FileInfo, error) { return f.info, nil }
func (f *regFile) Close() error {
	if f.closed {
		return &fs.PathError{Op: "close", Path: f.info.name, Err: fs.ErrClosed}
	}
	f.closed = true
	return nil
}

func (f *regFile) Read(p []byte) (int, error) {
	n, err := f.ReadAt(p, f.off)
	f.off += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

// ReadAt reads the file's content; non-regular files (devices, FIFOs)
// read as empty.
func (f *regFile) ReadAt(p []byte, off int64) (int, error) {
	if f.closed {
		return 0, &fs.PathError{Op: "read", Path: f.info.name, Err: fs.ErrClosed}
	}
	if f.info.toc.Type(f.info.data) != TypeReg {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	return f.r.ReadFileAt(f.info.data, p, off)
}

func (f *regFile) Seek(offset int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		offset += f.off
	case io.SeekEnd:
		offset += f.info.Size()
	default:
		return 0, fs.ErrInvalid
	}
	if offset < 0 {
		return 0, fs.ErrInvalid
	}
	f.off = offset
	return offset, nil
}

type dirFile struct {
	r      *Reader
	info   *fileInfo
	next   int // children returned so far
	closed bool
}

func (d *dirFile) Stat() (fs.FileInfo, error) { return d.info, nil }
func (d *dirFile) Read([]byte) (int, error) {
	return 0, &fs.PathError{Op: "read", Path: d.info.name, Err: errors.New("is a directory")}
}
func (d *dirFile) Close() error {
	if d.closed {
		return &fs.PathError{Op: "close", Path: d.info.name, Err: fs.ErrClosed}
	}
	d.closed = true
	return nil
}

func (d *dirFile) ReadDir(count int) ([]fs.DirEntry, error) {
	t := d.r.toc
	first, n := t.ChildRange(d.info.data)
	left := n - d.next
	if count > 0 && left == 0 {
		return nil, io.EOF
	}
	if count > 0 && count < left {
		left = count
	}
	out := make([]fs.DirEntry, left)
	for k := range out {
		c := first + d.next + k
		out[k] = fs.FileInfoToDirEntry(d.r.info(c, t.BaseName(c)))
	}
	d.next += left
	return out, nil
}
