package fetch

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// registryBinary finds the distribution registry built by hack/deps.sh.
func registryBinary(t *testing.T) string {
	t.Helper()
	var candidates []string
	if d := os.Getenv("ENVSNAP_TOOLS"); d != "" {
		candidates = append(candidates, filepath.Join(d, "registry"))
	}
	candidates = append(candidates, "../../bin/tools/registry")
	for _, c := range candidates {
		if fi, err := os.Stat(c); err == nil && fi.Mode()&0o111 != 0 {
			abs, _ := filepath.Abs(c)
			return abs
		}
	}
	prereq.Missing(t, "distribution registry binary not found (run `make deps`); looked in %v", candidates)
	return ""
}

// startDistribution runs the real registry on a free loopback port with
// filesystem storage in a temp dir and returns its host:port.
func startDistribution(t *testing.T) string {
	t.Helper()
	bin := registryBinary(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	dir := t.TempDir()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n", filepath.Join(dir, "data"), addr)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	cmd := exec.Command(bin, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return addr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("registry did not start: %v\n%s", err, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pushBlob uploads b monolithically: POST an upload session, PUT ?digest=.
func pushBlob(t *testing.T, host, repo string, b []byte) ocispec.Descriptor {
	t.Helper()
	d := digest.FromBytes(b)
	resp, err := http.Post("http://"+host+"/v2/"+repo+"/blobs/uploads/", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("start upload: %s", resp.Status)
	}
	loc, err := resp.Location()
	if err != nil {
		t.Fatal(err)
	}
	q := loc.Query()
	q.Set("digest", d.String())
	loc.RawQuery = q.Encode()
	req, _ := http.NewRequest(http.MethodPut, loc.String(), bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("finish upload: %s", resp.Status)
	}
	return ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: d, Size: int64(len(b))}
}

func TestDistributionRegistry(t *testing.T) {
	checkGoroutines(t)
	host := startDistribution(t)
	r := rand.New(rand.NewPCG(31, 32))
	files := []testFile{
		{"usr/bin/tool", randBytes(r, 900000)},
		{"etc/conf", []byte("key = value\n")},
		{"lib/data.bin", randBytes(r, 300000)},
	}
	blob, toc := testLayer(t, testChunkSize, files...)
	desc := pushBlob(t, host, "envsnap/base", blob)

	// Hosts configured the way the daemon does (certs.d-less defaults),
	// plain HTTP for the loopback registry.
	hosts := config.ConfigureHosts(context.Background(), config.HostOptions{DefaultScheme: "http"})
	ref := host + "/envsnap/base:1"
	br, err := NewBlobReader(hosts, ref, desc)
	if err != nil {
		t.Fatal(err)
	}
	for _, rg := range [][2]int64{{0, 1}, {12345, 67890}, {desc.Size - 100, 100}} {
		got, err := br.ReadRange(context.Background(), rg[0], rg[1])
		if err != nil {
			t.Fatalf("ReadRange(%d, %d): %v", rg[0], rg[1], err)
		}
		if !bytes.Equal(got, blob[rg[0]:rg[0]+rg[1]]) {
			t.Fatalf("ReadRange(%d, %d): wrong bytes", rg[0], rg[1])
		}
	}
	if br.RangeIgnored() {
		t.Error("distribution honours Range but was detected as ignoring it")
	}
	got, err := layerfmt.ReadTOC(context.Background(), br.ReaderAt(context.Background()), desc.Size, "")
	if err != nil || got.Len() != toc.Len() {
		t.Fatalf("ReadTOC over HTTP: %v", err)
	}

	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	l := NewLayer(br, toc, cache, WithReadAhead(0), WithFillBatch(256<<10, 2))
	defer l.Close()
	for _, f := range files {
		i, ok := toc.Lookup(f.name)
		if !ok {
			t.Fatalf("%s missing", f.name)
		}
		c := toc.Chunks(i)[len(toc.Chunks(i))-1]
		out, err := readChunk(l, c)
		if err != nil || !bytes.Equal(out, f.data[c.FileOffset:c.FileOffset+c.Size]) {
			t.Fatalf("ReadChunk of %s: %v", f.name, err)
		}
	}
	l.StartFill(context.Background())
	waitFilled(t, l)
}
