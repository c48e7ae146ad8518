package devenv

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Registry is a distribution registry on loopback behind an in-process
// reverse proxy. Clients use Host (the proxy), so the harness can count what
// the registry serves and tests can inject faults.
type Registry struct {
	// Host is "127.0.0.1:PORT" (another address with
	// WithRegistryListenIP), the address clients use.
	Host string
	// StorageDir is the registry's filesystem storage root; tests that
	// corrupt blobs edit files below it.
	StorageDir string
	backend    string
	proc       *Process
	server     *http.Server

	blobBytes    atomic.Int64
	blobRequests atomic.Int64
	uploads      atomic.Int64
	mu           sync.Mutex
	perBlob      map[string]int64
	uploaded     []string
	mounted      []string
	intercept    func(http.ResponseWriter, *http.Request) bool
	front        io.Closer
}

// RegistryNetwork places the registry behind a network of its own, e.g. a
// shaped link: the benchmark runs the registry in a network namespace
// behind a latency proxy. The counting proxy stays in front of it all.
type RegistryNetwork interface {
	// Command returns how to run the registry binary with args.
	Command(bin string, args ...string) *exec.Cmd
	// ListenAddr is the host:port the registry listens on.
	ListenAddr() string
	// Front returns the address clients' traffic is forwarded to in order
	// to reach listenAddr, and a closer for whatever it started.
	Front(listenAddr string) (string, io.Closer, error)
}

// WithRegistryNetwork runs the registry behind n.
func WithRegistryNetwork(n RegistryNetwork) Option {
	return func(o *options) { o.registryNet = n }
}

func (e *Env) startRegistry() (*Registry, error) {
	r, err := startRegistry(e.Dir, e.opts.registryNet, e.opts.registryIP)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.processes = append(e.processes, r.proc)
	e.mu.Unlock()
	e.onClose(r.Close)
	return r, nil
}

// StartRegistry starts the registry binary from the tools dir on a free
// loopback port, storing below dir, with the counting proxy in front of it.
// Close stops both.
func StartRegistry(dir string) (*Registry, error) { return StartRegistryOn(dir, nil) }

// StartRegistryOn is StartRegistry behind network n (nil: plain loopback).
func StartRegistryOn(dir string, n RegistryNetwork) (*Registry, error) {
	return startRegistry(dir, n, "127.0.0.1")
}

// startRegistry is StartRegistryOn with the counting proxy on ip.
func startRegistry(dir string, n RegistryNetwork, ip string) (_ *Registry, retErr error) {
	bin, err := Tool("registry")
	if err != nil {
		return nil, err
	}
	storage := filepath.Join(dir, "registry")
	if err := os.MkdirAll(storage, 0o700); err != nil {
		return nil, err
	}
	// The proxy's port is taken before the registry's is picked: picked
	// after, the kernel could hand it the port freePort just closed, and the
	// proxy would forward to itself until it ran out of descriptors.
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return nil, err
	}
	r := &Registry{StorageDir: storage, Host: ln.Addr().String(), perBlob: map[string]int64{}}
	proxy := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http"})
	direct := proxy.Director
	proxy.Director = func(req *http.Request) {
		direct(req)
		r.mu.Lock()
		req.URL.Host = r.backend
		r.mu.Unlock()
	}
	// Connection errors while the backend starts are expected; the readiness
	// poll reports real failures.
	proxy.ErrorLog = log.New(io.Discard, "", 0)
	r.server = &http.Server{Handler: r.handler(proxy), ReadHeaderTimeout: 10 * time.Second}
	go r.server.Serve(ln)
	defer func() {
		if retErr != nil {
			r.Close()
		}
	}()

	// Another process can bind the picked port before the registry does; a
	// fresh port is picked then, a few times.
	const attempts = 3
	for attempt := 1; ; attempt++ {
		err := r.startBackend(dir, bin, storage, n)
		if err == nil {
			return r, nil
		}
		if n != nil || attempt == attempts || r.proc == nil || !r.proc.LogContains("address already in use") {
			return nil, err
		}
		r.proc.Stop(10 * time.Second)
	}
}

// startBackend starts the registry process behind the proxy and waits
// until /v2/ answers through it.
func (r *Registry) startBackend(dir, bin, storage string, n RegistryNetwork) error {
	listen := ""
	if n != nil {
		listen = n.ListenAddr()
	} else {
		ports, err := FreePorts(1)
		if err != nil {
			return err
		}
		listen = fmt.Sprintf("127.0.0.1:%d", ports[0])
	}
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
http:
  addr: %s
`, storage, listen)
	cfgPath := filepath.Join(dir, "registry.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}
	cmd := exec.Command(bin, "serve", cfgPath)
	if n != nil {
		cmd = n.Command(bin, "serve", cfgPath)
	}
	proc, err := StartCommand(dir, "registry", nil, cmd)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.proc, r.backend = proc, listen
	r.mu.Unlock()
	if n != nil {
		front, closer, err := n.Front(listen)
		if err != nil {
			return fmt.Errorf("registry network: %w", err)
		}
		r.mu.Lock()
		r.backend, r.front = front, closer
		r.mu.Unlock()
	}
	if err := waitFor(20*time.Second, "registry to answer /v2/", func() error {
		if exited, err := proc.Exited(); exited {
			return fmt.Errorf("registry exited: %v", err)
		}
		resp, err := http.Get("http://" + r.Host + "/v2/")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET /v2/: %s", resp.Status)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("start registry: %w\n%s", err, proc.LogTail(30))
	}
	return nil
}

func (r *Registry) handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		intercept := r.intercept
		r.mu.Unlock()
		if intercept != nil && intercept(w, req) {
			return
		}
		if req.Method == http.MethodPost || req.Method == http.MethodPatch ||
			(req.Method == http.MethodPut && strings.Contains(req.URL.Path, "/blobs/uploads/")) {
			r.uploads.Add(1)
			r.mu.Lock()
			if d := req.URL.Query().Get("digest"); req.Method == http.MethodPut && d != "" {
				r.uploaded = append(r.uploaded, d)
			}
			if d := req.URL.Query().Get("mount"); req.Method == http.MethodPost && d != "" {
				r.mounted = append(r.mounted, d)
			}
			r.mu.Unlock()
		}
		if req.Method != http.MethodGet || !strings.Contains(req.URL.Path, "/blobs/sha256:") {
			next.ServeHTTP(w, req)
			return
		}
		cw := &countingWriter{ResponseWriter: w}
		next.ServeHTTP(cw, req)
		r.blobRequests.Add(1)
		r.blobBytes.Add(cw.n)
		dgst := req.URL.Path[strings.LastIndex(req.URL.Path, "/")+1:]
		r.mu.Lock()
		r.perBlob[dgst] += cw.n
		r.mu.Unlock()
	})
}

// Close stops the proxy and the registry process.
func (r *Registry) Close() {
	if r.server != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.server.Shutdown(ctx)
	}
	if r.front != nil {
		r.front.Close()
	}
	if r.proc != nil {
		r.proc.Stop(10 * time.Second)
	}
}

// Intercept installs f in front of the registry; when f returns true it has
// answered the request itself. Pass nil to remove it.
func (r *Registry) Intercept(f func(http.ResponseWriter, *http.Request) bool) {
	r.mu.Lock()
	r.intercept = f
	r.mu.Unlock()
}

// BlobBytesServed is the number of blob body bytes the registry served.
func (r *Registry) BlobBytesServed() int64 { return r.blobBytes.Load() }

// BlobRequests is the number of blob GET requests served.
func (r *Registry) BlobRequests() int64 { return r.blobRequests.Load() }

// UploadRequests counts blob upload requests (POST, PATCH, PUT to uploads).
func (r *Registry) UploadRequests() int64 { return r.uploads.Load() }

// BlobBytesServedFor is the number of body bytes served for one blob digest.
func (r *Registry) BlobBytesServedFor(dgst string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.perBlob[dgst]
}

// UploadedDigests lists the blobs whose bytes were uploaded (completed
// PUTs), in order.
func (r *Registry) UploadedDigests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.uploaded...)
}

// MountRequests lists the blobs clients asked to cross-repository mount.
func (r *Registry) MountRequests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.mounted...)
}

// ResetCounters zeroes the byte and request counters.
func (r *Registry) ResetCounters() {
	r.blobBytes.Store(0)
	r.blobRequests.Store(0)
	r.uploads.Store(0)
	r.mu.Lock()
	r.perBlob = map[string]int64{}
	r.uploaded, r.mounted = nil, nil
	r.mu.Unlock()
}

// BlobPath is where the registry stores a blob's data on disk.
func (r *Registry) BlobPath(dgst string) string {
	hex := strings.TrimPrefix(dgst, "sha256:")
	return filepath.Join(r.StorageDir, "docker/registry/v2/blobs/sha256", hex[:2], hex, "data")
}

type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n += int64(n)
	return n, err
}

func (c *countingWriter) Flush() {
	if f, ok := c.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// WriteHostsDir writes a containerd certs.d tree under dir that makes host
// reachable over plain HTTP, the same file containerd, our daemon and our
// CLI all read.
func WriteHostsDir(dir, host string) error {
	hostDir := filepath.Join(dir, host)
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		return err
	}
	toml := fmt.Sprintf("server = \"http://%s\"\n\n[host.\"http://%s\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n", host, host)
	return os.WriteFile(filepath.Join(hostDir, "hosts.toml"), []byte(toml), 0o644)
}

// FreePorts returns n distinct TCP ports free on the loopback now. All n
// are held until the last is picked, so none is returned twice; another
// process can still bind one before the caller does.
func FreePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("pick a free loopback port: %w", err)
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
