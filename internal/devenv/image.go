package devenv

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path"
	"runtime"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/layerfmt"
)

// File is one entry added to a test image.
type File struct {
	Path    string      // absolute path in the image
	Mode    os.FileMode // permission bits; 0 means 0644 (0755 for dirs)
	Data    []byte      // contents of a regular file
	Size    int64       // with Seed: Size deterministic random bytes instead of Data
	Seed    int64
	Symlink string // when set, a symlink to this target
	Dir     bool   // when set, a directory
}

// RandomFile is a regular file of size deterministic pseudo-random bytes:
// incompressible, so byte counts on the wire mean something.
func RandomFile(p string, size, seed int64) File {
	return File{Path: p, Size: size, Seed: seed, Mode: 0o644}
}

// Reader returns the file's contents.
func (f File) Reader() io.Reader {
	if f.Seed != 0 || (f.Size > 0 && f.Data == nil) {
		return io.LimitReader(rand.New(rand.NewSource(f.Seed)), f.Size)
	}
	return bytes.NewReader(f.Data)
}

// Digest is the sha256 of the file's contents.
func (f File) Digest() digest.Digest {
	d, err := digest.FromReader(f.Reader())
	if err != nil {
		panic(err)
	}
	return d
}

// Image describes an image pushed by the harness.
type Image struct {
	Ref      string // full reference, HOST/name:tag
	Manifest ocispec.Descriptor
	Config   ocispec.Descriptor
	Layers   []ocispec.Descriptor
	// LayerResults describe the layers in the envsnap format (entries are
	// nil for gzip layers).
	LayerResults []*layerfmt.WriteResult
}

// ImageOption adjusts a test image.
type ImageOption func(*imageSpec)

type imageSpec struct {
	entrypoint []string
	cmd        []string
	env        []string
	workdir    string
	noBusybox  bool
	lazy       bool
	lazyOpts   []layerfmt.WriteOption
}

// WithLazyLayers encodes every layer in the envsnap format (what
// `containerd-envsnap convert` writes) instead of gzip.
func WithLazyLayers(opts ...layerfmt.WriteOption) ImageOption {
	return func(s *imageSpec) { s.lazy, s.lazyOpts = true, opts }
}

// WithEntrypoint sets the image's entrypoint (default none, cmd /bin/sh).
func WithEntrypoint(args ...string) ImageOption {
	return func(s *imageSpec) { s.entrypoint = args }
}

// WithCmd sets the image's cmd.
func WithCmd(args ...string) ImageOption { return func(s *imageSpec) { s.cmd = args } }

// WithImageEnv sets the image's environment.
func WithImageEnv(env ...string) ImageOption { return func(s *imageSpec) { s.env = env } }

// WithoutBusybox builds an image holding only the given files.
func WithoutBusybox() ImageOption { return func(s *imageSpec) { s.noBusybox = true } }

// LayerTar builds an uncompressed tar of files, parents created as needed,
// in a deterministic order with fixed timestamps.
func LayerTar(files []File) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Unix(1700000000, 0)
	seen := map[string]bool{}
	sorted := append([]File(nil), files...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Path < sorted[j].Path })
	var addDir func(p string) error
	addDir = func(p string) error {
		if p == "/" || p == "." || seen[p] {
			return nil
		}
		if err := addDir(path.Dir(p)); err != nil {
			return err
		}
		seen[p] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(p, "/") + "/", Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX})
	}
	for _, f := range sorted {
		p := path.Clean("/" + f.Path)
		if err := addDir(path.Dir(p)); err != nil {
			return nil, err
		}
		name := strings.TrimPrefix(p, "/")
		mode := int64(f.Mode.Perm())
		// Go's fs.FileMode keeps these bits high; tar wants the Unix ones.
		for bit, unix := range map[os.FileMode]int64{os.ModeSetuid: 0o4000, os.ModeSetgid: 0o2000, os.ModeSticky: 0o1000} {
			if f.Mode&bit != 0 {
				mode |= unix
			}
		}
		switch {
		case f.Dir:
			if mode == 0 {
				mode = 0o755
			}
			seen[p] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: mode, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
		case f.Symlink != "":
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: f.Symlink, Mode: 0o777, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
		default:
			if mode == 0 {
				mode = 0o644
			}
			size := int64(len(f.Data))
			if f.Seed != 0 || (f.Size > 0 && f.Data == nil) {
				size = f.Size
			}
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: size, Mode: mode, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
			if _, err := io.Copy(tw, f.Reader()); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

var (
	busyboxOnce  sync.Once
	busyboxFiles []File
	busyboxErr   error
)

// BusyboxFiles is a minimal userland: the static busybox from Debian's
// busybox-static package with a symlink per applet, /etc/passwd and the
// usual empty directories.
func BusyboxFiles() ([]File, error) {
	busyboxOnce.Do(func() {
		bin, err := os.ReadFile("/bin/busybox")
		if err != nil {
			busyboxErr = fmt.Errorf("read /bin/busybox (install busybox-static, `make deps`): %w", err)
			return
		}
		out, err := exec.Command("/bin/busybox", "--list").Output()
		if err != nil {
			busyboxErr = fmt.Errorf("busybox --list: %w", err)
			return
		}
		files := []File{
			{Path: "/bin/busybox", Data: bin, Mode: 0o755},
			{Path: "/etc/passwd", Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")},
			{Path: "/etc/group", Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
			{Path: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
			{Path: "/root", Dir: true, Mode: 0o700},
			{Path: "/proc", Dir: true}, {Path: "/sys", Dir: true}, {Path: "/dev", Dir: true},
		}
		for _, applet := range strings.Fields(string(out)) {
			if applet == "busybox" {
				continue
			}
			files = append(files, File{Path: "/bin/" + applet, Symlink: "busybox"})
		}
		busyboxFiles = files
	})
	return busyboxFiles, busyboxErr
}

// PushImage builds a two-layer image (busybox userland, then files) and
// pushes it to the env's registry as name (e.g. "test/hello:1"). It returns
// the full reference and descriptors.
func (e *Env) PushImage(ctx context.Context, name string, files []File, opts ...ImageOption) (Image, error) {
	return e.PushImageLayers(ctx, name, [][]File{files}, opts...)
}

// PushImageLayers is PushImage with one layer per file list, on top of the
// busybox layer (unless WithoutBusybox); empty lists add no layer.
func (e *Env) PushImageLayers(ctx context.Context, name string, layers [][]File, opts ...ImageOption) (Image, error) {
	var spec imageSpec
	for _, o := range opts {
		o(&spec)
	}
	if !spec.noBusybox {
		bb, err := BusyboxFiles()
		if err != nil {
			return Image{}, err
		}
		layers = append([][]File{bb}, layers...)
	}
	var tars [][]byte
	for _, files := range layers {
		if len(files) == 0 {
			continue
		}
		tb, err := LayerTar(files)
		if err != nil {
			return Image{}, err
		}
		tars = append(tars, tb)
	}
	img, err := e.pushTarLayers(ctx, e.Registry.Host+"/"+name, tars, spec)
	if err != nil {
		return img, fmt.Errorf("push image %s: %w", name, err)
	}
	return img, nil
}

// encodeLayer compresses one layer tar: gzip, as most registries hold
// images, or the envsnap format with WithLazyLayers.
func encodeLayer(ctx context.Context, tb []byte, spec imageSpec) (LayerBlob, error) {
	if spec.lazy {
		var blob bytes.Buffer
		res, err := layerfmt.Convert(ctx, &blob, bytes.NewReader(tb), spec.lazyOpts...)
		if err != nil {
			return LayerBlob{}, fmt.Errorf("convert layer: %w", err)
		}
		return LayerBlob{
			Desc:   ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: res.Digest, Size: res.Size, Annotations: res.Annotations()},
			DiffID: res.DiffID, Data: blob.Bytes(), Result: res,
		}, nil
	}
	return GzipLayer(tb)
}

// GzipLayer encodes an uncompressed layer tar as a tar+gzip layer, the way
// most registries hold images.
func GzipLayer(tb []byte) (LayerBlob, error) {
	var gz bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&gz, gzip.BestSpeed)
	if _, err := zw.Write(tb); err != nil {
		return LayerBlob{}, err
	}
	if err := zw.Close(); err != nil {
		return LayerBlob{}, err
	}
	return LayerBlob{
		Desc:   ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(gz.Bytes()), Size: int64(gz.Len())},
		DiffID: digest.FromBytes(tb), Data: gz.Bytes(),
	}, nil
}

func (e *Env) pushTarLayers(ctx context.Context, ref string, tars [][]byte, spec imageSpec) (Image, error) {
	layers := make([]LayerBlob, len(tars))
	for i, tb := range tars {
		var err error
		if layers[i], err = encodeLayer(ctx, tb, spec); err != nil {
			return Image{Ref: ref}, err
		}
	}
	return e.pushLayerBlobs(ctx, ref, layers, spec)
}

// LayerBlob is an encoded layer ready to push.
type LayerBlob struct {
	Desc   ocispec.Descriptor
	DiffID digest.Digest
	Data   []byte
	// Result describes an envsnap-format layer (nil for gzip layers).
	Result *layerfmt.WriteResult
}

// PushLayerBlobs pushes an image made of already encoded layers (e.g.
// hand-crafted hostile blobs) as name, with the config opts describe.
func (e *Env) PushLayerBlobs(ctx context.Context, name string, layers []LayerBlob, opts ...ImageOption) (Image, error) {
	var spec imageSpec
	for _, o := range opts {
		o(&spec)
	}
	return e.pushLayerBlobs(ctx, e.Registry.Host+"/"+name, layers, spec)
}

func (e *Env) pushLayerBlobs(ctx context.Context, ref string, layers []LayerBlob, spec imageSpec) (Image, error) {
	cs := e.ContentStore
	img := Image{Ref: ref}
	cfg := ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
		RootFS:   ocispec.RootFS{Type: "layers"},
		Config: ocispec.ImageConfig{
			Entrypoint: spec.entrypoint,
			Cmd:        spec.cmd,
			Env:        append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, spec.env...),
			WorkingDir: spec.workdir,
		},
	}
	if cfg.Config.Cmd == nil && cfg.Config.Entrypoint == nil {
		cfg.Config.Cmd = []string{"/bin/sh"}
	}
	for _, l := range layers {
		if err := writeDesc(ctx, cs, l.Desc, l.Data); err != nil {
			return img, err
		}
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, l.DiffID)
		img.Layers = append(img.Layers, l.Desc)
		img.LayerResults = append(img.LayerResults, l.Result)
	}
	cfgBytes, err := json.Marshal(cfg)
	if err != nil {
		return img, err
	}
	if img.Config, err = writeBlob(ctx, cs, ocispec.MediaTypeImageConfig, cfgBytes); err != nil {
		return img, err
	}
	manifest := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    img.Config,
		Layers:    img.Layers,
	}
	mb, err := json.Marshal(manifest)
	if err != nil {
		return img, err
	}
	if img.Manifest, err = writeBlob(ctx, cs, ocispec.MediaTypeImageManifest, mb); err != nil {
		return img, err
	}
	return img, e.Push(ctx, ref, img.Manifest)
}

// Push pushes desc and everything it references from the harness content
// store to ref in the registry.
func (e *Env) Push(ctx context.Context, ref string, desc ocispec.Descriptor) error {
	pusher, err := e.Resolver().Pusher(ctx, ref)
	if err != nil {
		return fmt.Errorf("pusher for %s: %w", ref, err)
	}
	if err := remotes.PushContent(ctx, pusher, desc, e.ContentStore, nil, platforms.All, nil); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	return nil
}

func writeBlob(ctx context.Context, cs content.Store, mediaType string, b []byte) (ocispec.Descriptor, error) {
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
	return desc, writeDesc(ctx, cs, desc, b)
}

func writeDesc(ctx context.Context, cs content.Store, desc ocispec.Descriptor, b []byte) error {
	if err := content.WriteBlob(ctx, cs, desc.Digest.String(), bytes.NewReader(b), desc); err != nil {
		return fmt.Errorf("write blob %s: %w", desc.Digest, err)
	}
	return nil
}
