use std::collections::HashMap;

/// The vertex at infinity.
pub const INF: u32 = u32::MAX;
const NONE: u32 = u32::MAX;

/// Faces opposite each vertex, ordered so that the opposite vertex is on their positive
/// side (even permutations of 0123).
const FACE: [[usize; 3]; 4] = [[1, 3, 2], [0, 2, 3], [0, 3, 1], [0, 1, 2]];

#[derive(Debug, Clone, Copy)]
struct Tet {
    v: [u32; 4],
    /// Neighbor across the face opposite `v[i]`.
    n: [u32; 4],
    alive: bool,
}

#[derive(Debug)]
pub struct Triangulation {
    pts: Vec<[i64; 3]>,
    tets: Vec<Tet>,
    /// Per tetrahedron: the insertion that last classified it, and how (1 in the
    /// cavity, 2 outside).
    seen: Vec<(u32, u8)>,
}

fn sub(a: &[i64; 3], b: &[i64; 3]) -> [i128; 3] {
    [
        i128::from(a[0] - b[0]),
        i128::from(a[1] - b[1]),
        i128::from(a[2] - b[2]),
    ]
}

fn det3(a: [i128; 3], b: [i128; 3], c: [i128; 3]) -> i128 {
    a[0] * (b[1] * c[2] - b[2] * c[1]) - a[1] * (b[0] * c[2] - b[2] * c[0])
        + a[2] * (b[0] * c[1] - b[1] * c[0])
}

/// Positive when `d` is on the positive side of the oriented triangle `abc`.
pub fn orient(a: &[i64; 3], b: &[i64; 3], c: &[i64; 3], d: &[i64; 3]) -> i128 {
    det3(sub(b, a), sub(c, a), sub(d, a))
}

/// Positive when `e` is strictly inside the circumsphere of the positively oriented `abcd`.
pub fn insphere(a: &[i64; 3], b: &[i64; 3], c: &[i64; 3], d: &[i64; 3], e: &[i64; 3]) -> i128 {
    let rows = [a, b, c, d].map(|p| {
        let q = sub(p, e);
        [q[0], q[1], q[2], q[0] * q[0] + q[1] * q[1] + q[2] * q[2]]
    });
    // Laplace expansion along the lifted column.
    let m = |i: usize, j: usize, k: usize| {
        let r = |x: usize| [rows[x][0], rows[x][1], rows[x][2]];
        det3(r(i), r(j), r(k))
    };
    let det = -rows[0][3] * m(1, 2, 3) + rows[1][3] * m(0, 2, 3) - rows[2][3] * m(0, 1, 3)
        + rows[3][3] * m(0, 1, 2);
    -det
}

/// Brings [`INF`] to the last position by an even permutation.
fn normalize(mut v: [u32; 4]) -> [u32; 4] {
    match v.iter().position(|&x| x == INF) {
        Some(0) => {
            v.swap(0, 3);
            v.swap(1, 2);
        }
        Some(1) => {
            v.swap(1, 3);
            v.swap(0, 2);
        }
        Some(2) => {
            v.swap(2, 3);
            v.swap(0, 1);
        }
        _ => {}
    }
    v
}

fn face_key(v: &[u32; 4], skip: usize) -> [u32; 3] {
    let mut k = [0u32; 3];
    let mut j = 0;
    for (i, &x) in v.iter().enumerate() {
        if i != skip {
            k[j] = x;
            j += 1;
        }
    }
    k.sort_unstable();
    k
}

impl Triangulation {
    /// Tetrahedralizes distinct points; None when they are all coplanar.
    pub fn build(pts: &[[i64; 3]]) -> Option<Triangulation> {
        let i0 = 0usize;
        let i1 = (1..pts.len()).find(|&i| pts[i] != pts[i0])?;
        let i2 = (1..pts.len()).find(|&i| {
            let (u, w) = (sub(&pts[i1], &pts[i0]), sub(&pts[i], &pts[i0]));
            u[1] * w[2] != u[2] * w[1] || u[2] * w[0] != u[0] * w[2] || u[0] * w[1] != u[1] * w[0]
        })?;
        let i3 = (1..pts.len()).find(|&i| orient(&pts[i0], &pts[i1], &pts[i2], &pts[i]) != 0)?;
        let mut first = [i0 as u32, i1 as u32, i2 as u32, i3 as u32];
        if orient(&pts[i0], &pts[i1], &pts[i2], &pts[i3]) < 0 {
            first.swap(1, 2);
        }
        let mut tri = Triangulation {
            pts: pts.to_vec(),
            tets: Vec::new(),
            seen: Vec::new(),
        };
        let mut new = vec![tri.push(first)];
        for f in FACE {
            // The outside of each face is the positive side of its reverse.
            new.push(tri.push(normalize([first[f[1]], first[f[0]], first[f[2]], INF])));
        }
        tri.link(&new, NONE);
        let mut last = 0u32;
        for i in 0..pts.len() as u32 {
            if !first.contains(&i) {
                last = tri.insert(i, last);
            }
        }
        Some(tri)
    }

    fn push(&mut self, v: [u32; 4]) -> u32 {
        self.tets.push(Tet {
            v,
            n: [NONE; 4],
            alive: true,
        });
        self.seen.push((NONE, 0));
        (self.tets.len() - 1) as u32
    }

    /// Links the faces shared among `new` tets, except the faces containing no `apex`
    /// (when `apex` is not NONE those are already linked).
    fn link(&mut self, new: &[u32], apex: u32) {
        let mut open: HashMap<[u32; 3], (u32, usize)> = HashMap::new();
        for &t in new {
            let v = self.tets[t as usize].v;
            for i in 0..4 {
                if apex != NONE && v[i] == apex {
                    continue;
                }
                let key = face_key(&v, i);
                if let Some((u, j)) = open.remove(&key) {
                    self.tets[t as usize].n[i] = u;
                    self.tets[u as usize].n[j] = t;
                } else {
                    open.insert(key, (t, i));
                }
            }
        }
        debug_assert!(open.is_empty(), "unmatched faces in the new tetrahedra");
    }

    fn p(&self, i: u32) -> &[i64; 3] {
        &self.pts[i as usize]
    }

    fn conflicts(&self, t: u32, q: &[i64; 3]) -> bool {
        let v = self.tets[t as usize].v;
        if v[3] == INF {
            let o = orient(self.p(v[0]), self.p(v[1]), self.p(v[2]), q);
            if o != 0 {
                return o > 0;
            }
            // On the hull plane: in conflict iff inside the hull triangle's circumcircle,
            // i.e. inside the circumsphere of the finite neighbor.
            let f = self.tets[t as usize].n[3];
            return self.conflicts(f, q);
        }
        insphere(self.p(v[0]), self.p(v[1]), self.p(v[2]), self.p(v[3]), q) > 0
    }

    /// A tetrahedron in conflict with `q`: visibility walk from `start`, then a scan.
    fn locate(&self, start: u32, q: &[i64; 3]) -> u32 {
        let mut t = start;
        let mut turn = 0usize;
        for _ in 0..4 * self.tets.len() + 16 {
            let tet = &self.tets[t as usize];
            if tet.v[3] == INF {
                if self.conflicts(t, q) {
                    return t;
                }
                t = tet.n[3];
                continue;
            }
            turn = turn.wrapping_add(1);
            let mut moved = false;
            for k in 0..4 {
                let i = (k + turn) % 4;
                let f = FACE[i].map(|j| tet.v[j]);
                if orient(self.p(f[0]), self.p(f[1]), self.p(f[2]), q) < 0 {
                    t = tet.n[i];
                    moved = true;
                    break;
                }
            }
            if !moved {
                return t;
            }
        }
        (0..self.tets.len() as u32)
            .rev()
            .find(|&t| self.tets[t as usize].alive && self.conflicts(t, q))
            .expect("some tetrahedron conflicts with a new point")
    }

    /// Inserts point `pi`; returns a new tetrahedron to start the next walk from.
    fn insert(&mut self, pi: u32, start: u32) -> u32 {
        let q = self.pts[pi as usize];
        let seed = self.locate(start, &q);
        self.seen[seed as usize] = (pi, 1);
        let mut cavity = vec![seed];
        let mut boundary = Vec::new();
        let mut k = 0;
        while k < cavity.len() {
            let t = cavity[k];
            k += 1;
            for i in 0..4 {
                let nb = self.tets[t as usize].n[i];
                let (stamp, mut status) = self.seen[nb as usize];
                if stamp != pi {
                    status = if self.conflicts(nb, &q) { 1 } else { 2 };
                    self.seen[nb as usize] = (pi, status);
                    if status == 1 {
                        cavity.push(nb);
                    }
                }
                if status == 2 {
                    boundary.push((t, i, nb));
                }
            }
        }
        let mut new = Vec::with_capacity(boundary.len());
        for (t, i, nb) in boundary {
            let v = self.tets[t as usize].v;
            let f = FACE[i].map(|j| v[j]);
            let nv = normalize([f[0], f[1], f[2], pi]);
            debug_assert!(
                nv[3] == INF
                    || orient(self.p(nv[0]), self.p(nv[1]), self.p(nv[2]), self.p(nv[3])) > 0,
                "flat tetrahedron"
            );
            let u = self.push(nv);
            let at = nv.iter().position(|&x| x == pi).expect("apex");
            self.tets[u as usize].n[at] = nb;
            let back = self.tets[nb as usize]
                .n
                .iter()
                .position(|&x| x == t)
                .expect("neighbor links back");
            self.tets[nb as usize].n[back] = u;
            new.push(u);
        }
        for &t in &cavity {
            self.tets[t as usize].alive = false;
        }
        self.link(&new, pi);
        new.iter()
            .copied()
            .find(|&t| self.tets[t as usize].v[3] != INF)
            .unwrap_or(new[0])
    }

    /// Vertex indices of the finite tetrahedra, positively oriented.
    pub fn finite_tets(&self) -> impl Iterator<Item = [u32; 4]> + '_ {
        self.tets
            .iter()
            .filter(|t| t.alive && t.v[3] != INF)
            .map(|t| t.v)
    }

    /// Checks the structure (tests): orientation, symmetric links, local Delaunay
    /// property, convex hull, and that the tetrahedra fill the hull exactly.
    #[cfg(test)]
    pub fn check(&self) -> Result<(), String> {
        let origin = self.pts[0];
        let (mut vol, mut hull) = (0i128, 0i128);
        for (ti, t) in self.tets.iter().enumerate().filter(|(_, t)| t.alive) {
            for i in 0..4 {
                let nb = &self.tets[t.n[i] as usize];
                if !nb.alive || !nb.n.contains(&(ti as u32)) {
                    return Err(format!("tet {ti}: bad link {i}"));
                }
            }
            let [a, b, c, d] = t.v;
            if d == INF {
                let (pa, pb, pc) = (self.p(a), self.p(b), self.p(c));
                if self.pts.iter().any(|q| orient(pa, pb, pc, q) > 0) {
                    return Err(format!("hull face {ti} not convex"));
                }
                hull -= orient(pa, pb, pc, &origin);
                continue;
            }
            let o = orient(self.p(a), self.p(b), self.p(c), self.p(d));
            if o <= 0 {
                return Err(format!("tet {ti} not positively oriented"));
            }
            vol += o;
            for i in 0..4 {
                let nb = &self.tets[t.n[i] as usize];
                let far =
                    nb.v.iter()
                        .copied()
                        .find(|x| !t.v.contains(x))
                        .expect("opposite");
                if far != INF
                    && insphere(self.p(a), self.p(b), self.p(c), self.p(d), self.p(far)) > 0
                {
                    return Err(format!("tet {ti} not locally Delaunay"));
                }
            }
        }
        if vol != hull {
            return Err(format!("volume {vol} != hull volume {hull}"));
        }
        Ok(())
    }
}
